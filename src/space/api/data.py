"""The data plane through the API: exec and file streams relayed to the sandbox's worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated, Any

import httpx
import wsproto.events as wse
from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from httpx_ws import AsyncWebSocketSession, HTTPXWSException
from httpx_ws import WebSocketDisconnect as UpstreamDisconnect
from starlette.types import Receive, Scope, Send

from space.api.deps import Caller, Services, Svc, ws_tenant
from space.api.errors import APIError
from space.api.schemas import ExecRequest as PublicExecRequest
from space.api.schemas import FileEntry, FileList, WriteResult
from space.db.store import NotFound
from space.worker.api.client import Worker
from space.worker.api.models import NDJSON, ExecRequest

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["data"])

AbsPath = Annotated[str, Query(pattern=r"^/", max_length=4096, description="absolute path")]


async def target(svc: Services, tenant_id: str, sandbox_id: str) -> Worker:
    """The worker of one of the caller's running sandboxes (404 for anyone else's); one the
    idle policy paused is resumed for the call."""
    row = await svc.in_use(await svc.store.get_sandbox(sandbox_id, tenant_id))
    return await svc.running_on(row)


class ClosingStream(StreamingResponse):
    """A streamed answer that always closes what it holds (an upstream worker stream, a place
    among the tenant's followers), even when the client leaves before the first byte (then the
    body generator never starts)."""

    def __init__(
        self, body: AsyncIterator[bytes], media_type: str | None, stack: AsyncExitStack
    ) -> None:
        super().__init__(body, media_type=media_type)
        self._stack = stack

    def on_close(self, callback: Callable[[], None]) -> None:
        """Called once the answer has ended, however it ended."""
        self._stack.callback(callback)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


async def relay(
    upstream: AbstractAsyncContextManager[httpx.Response], media_type: str
) -> ClosingStream:
    """Open the worker's stream first (so its errors become ours), then pass the body on."""
    stack = AsyncExitStack()
    resp = await stack.enter_async_context(upstream)
    return ClosingStream(resp.aiter_raw(), media_type, stack)


@router.post("/exec", response_class=StreamingResponse)
async def exec_stream(
    sandbox_id: str, body: PublicExecRequest, svc: Svc, caller: Caller
) -> StreamingResponse:
    """Run a command; the answer streams NDJSON events: start, stdout, stderr, exit."""
    if body.pty:
        raise APIError(400, "a PTY needs the interactive WebSocket: /exec/ws")
    worker = await target(svc, caller.id, sandbox_id)
    req = ExecRequest.model_validate(
        body.model_dump(exclude_none=True, exclude={"pty", "rows", "cols"})
    )
    return await relay(svc.workers.exec_stream(worker, sandbox_id, req), NDJSON)


@router.websocket("/exec/ws")
async def exec_ws(websocket: WebSocket, sandbox_id: str) -> None:
    await relay_ws(websocket, sandbox_id, lambda svc, w: svc.workers.exec_ws(w, sandbox_id))


UpstreamWS = Callable[[Services, Worker], AbstractAsyncContextManager[AsyncWebSocketSession]]


async def relay_ws(websocket: WebSocket, sandbox_id: str, open_upstream: UpstreamWS) -> None:
    """A tenant's WebSocket to one of its sandboxes, pumped both ways to the worker's."""
    svc: Services = websocket.app.state.services
    try:
        caller = await ws_tenant(websocket)
        worker = await target(svc, caller.id, sandbox_id)
    except (APIError, NotFound) as e:
        await websocket.close(code=4404 if isinstance(e, NotFound) else 4000 + e.status,
                              reason=str(e)[:120])  # fmt: skip
        return
    await websocket.accept()
    try:
        async with open_upstream(svc, worker) as up:
            await _pump_ws(websocket, up)
    except (HTTPXWSException, httpx.TransportError) as e:
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.send_json({"type": "error", "code": "upstream", "message": str(e)})
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client may be gone
        await websocket.close()


async def _pump_ws(client: WebSocket, up: AsyncWebSocketSession) -> None:
    async def downstream() -> None:
        while True:
            msg = await up.receive()
            if isinstance(msg, wse.TextMessage):
                await client.send_text(msg.data)
            elif isinstance(msg, wse.BytesMessage):
                await client.send_bytes(bytes(msg.data))
            elif isinstance(msg, wse.CloseConnection):
                return

    async def upstream() -> None:
        while True:
            msg = await client.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes") is not None:
                await up.send_bytes(msg["bytes"])
            elif msg.get("text") is not None:
                await up.send_text(msg["text"])

    quiet = (UpstreamDisconnect, WebSocketDisconnect, HTTPXWSException)
    await until_first(downstream(), upstream(), quiet=quiet)


async def until_first(
    *jobs: Coroutine[Any, Any, None], quiet: tuple[type[BaseException], ...] = ()
) -> None:
    """Run the jobs until one of them ends, then cancel the others and wait for them (the
    directions of a relay: either side's end is the relay's). `quiet`: how they may end."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, *quiet):
                await task


@router.get("/files", response_class=StreamingResponse)
async def download(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> StreamingResponse:
    worker = await target(svc, caller.id, sandbox_id)
    return await relay(svc.workers.download(worker, sandbox_id, path), "application/octet-stream")


@router.put("/files", response_model=WriteResult)
async def upload(
    sandbox_id: str,
    path: AbsPath,
    request: Request,
    svc: Svc,
    caller: Caller,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    make_parents: bool = False,
) -> WriteResult:
    worker = await target(svc, caller.id, sandbox_id)
    written = await svc.workers.upload(
        worker, sandbox_id, path, request.stream(), mode=mode, make_parents=make_parents
    )
    return WriteResult(size=written.size)


@router.get("/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> FileList:
    worker = await target(svc, caller.id, sandbox_id)
    listing = await svc.workers.list_dir(worker, sandbox_id, path)
    return FileList.model_validate(listing.model_dump())


@router.get("/files/stat", response_model=FileEntry)
async def stat_file(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> FileEntry:
    worker = await target(svc, caller.id, sandbox_id)
    entry = await svc.workers.stat(worker, sandbox_id, path)
    return FileEntry.model_validate(entry.model_dump())


@router.delete("/files", status_code=204)
async def remove_file(
    sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller, recursive: bool = False
) -> Response:
    worker = await target(svc, caller.id, sandbox_id)
    await svc.workers.remove(worker, sandbox_id, path, recursive)
    return Response(status_code=204)


@router.post("/files/rename", response_model=FileEntry)
async def rename_file(
    sandbox_id: str, path: AbsPath, to: AbsPath, svc: Svc, caller: Caller, overwrite: bool = False
) -> FileEntry:
    worker = await target(svc, caller.id, sandbox_id)
    entry = await svc.workers.rename(worker, sandbox_id, path, to, overwrite)
    return FileEntry.model_validate(entry.model_dump())


@router.get("/files/watch", response_class=StreamingResponse)
async def watch_files(
    sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller, recursive: bool = False
) -> StreamingResponse:
    """What changes in a directory (and under it, if `recursive`), as NDJSON: `watching` once
    the watch is set, then `{"type", "path", "is_dir"}` per event (`create`, `write`,
    `remove`, `rename` (a move's old name; its new one is a `create`), `chmod`, or `overflow`:
    events were lost), then `end` if the directory was removed or moved. Leaving stops it."""
    worker = await target(svc, caller.id, sandbox_id)
    return await relay(svc.workers.watch(worker, sandbox_id, path, recursive), NDJSON)


@router.get("/logs", response_class=StreamingResponse)
async def read_logs(
    sandbox_id: str,
    svc: Svc,
    caller: Caller,
    tail: Annotated[int, Query(ge=0, le=1 << 20, description="bytes of its past")] = 65536,
    follow: Annotated[bool, Query(description="then what comes, as it comes")] = False,
) -> StreamingResponse:
    """Its serial console (text): the guest kernel's and its agent's messages, and whatever the
    guest writes to /dev/console; read on its worker, so paused sandboxes have theirs too.
    Following ends when its VM stops (a suspend, a delete) or the caller leaves."""
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    if row["state"] not in ("running", "paused"):
        raise APIError(409, f"sandbox {sandbox_id} is {row['state']}: only a live VM has a "
                       "console", state=row["state"])  # fmt: skip
    worker = await svc.worker_of(row)
    if not follow:
        return await relay(svc.workers.console(worker, sandbox_id, tail, False), "text/plain")
    release = svc.follow(caller.id)
    try:
        answer = await relay(svc.workers.console(worker, sandbox_id, tail, True), "text/plain")
    except BaseException:
        release()
        raise
    answer.on_close(release)
    return answer


@router.post("/files/mkdir", response_model=FileEntry)
async def make_dir(
    sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller, parents: bool = False
) -> FileEntry:
    worker = await target(svc, caller.id, sandbox_id)
    entry = await svc.workers.mkdir(worker, sandbox_id, path, parents)
    return FileEntry.model_validate(entry.model_dump())

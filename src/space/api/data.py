"""The data plane through the API: exec and file streams relayed to the sandbox's worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from typing import Annotated, Any

import httpx
import wsproto.events as wse
from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response, StreamingResponse
from httpx_ws import AsyncWebSocketSession, HTTPXWSException, aconnect_ws
from httpx_ws import WebSocketDisconnect as UpstreamDisconnect
from starlette.types import Receive, Scope, Send

from space.api.deps import Caller, Services, Svc, ws_tenant
from space.api.errors import APIError
from space.api.schemas import ExecRequest, FileEntry, FileList, WriteResult
from space.db.store import NotFound

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["data"])

AbsPath = Annotated[str, Query(pattern=r"^/", max_length=4096, description="absolute path")]


async def target(svc: Services, tenant_id: str, sandbox_id: str) -> str:
    return await svc.worker_url(await svc.store.get_sandbox(sandbox_id, tenant_id))


class _RelayResponse(StreamingResponse):
    """A streamed answer that always closes its upstream worker stream, even when the client
    leaves before the first byte (then the body generator never starts)."""

    def __init__(self, body: AsyncIterator[bytes], media_type: str, stack: AsyncExitStack):
        super().__init__(body, media_type=media_type)
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stack.aclose()


async def relay(
    svc: Services, method: str, url: str, media_type: str, **kw: Any
) -> StreamingResponse:
    """Open the worker's stream first (so its errors become ours), then pass the body on."""
    stack = AsyncExitStack()
    resp = await stack.enter_async_context(svc.workers.stream(method, url, **kw))
    return _RelayResponse(resp.aiter_raw(), media_type, stack)


@router.post("/exec", response_class=StreamingResponse)
async def exec_stream(
    sandbox_id: str, body: ExecRequest, svc: Svc, caller: Caller
) -> StreamingResponse:
    """Run a command; the answer streams NDJSON events: start, stdout, stderr, exit."""
    if body.pty:
        raise APIError(400, "a PTY needs the interactive WebSocket: /exec/ws")
    url = await target(svc, caller.id, sandbox_id)
    req = body.model_dump(exclude_none=True, exclude={"pty", "rows", "cols"})
    return await relay(svc, "POST", f"{url}/exec", "application/x-ndjson", json=req)


@router.websocket("/exec/ws")
async def exec_ws(websocket: WebSocket, sandbox_id: str) -> None:
    svc: Services = websocket.app.state.services
    try:
        caller = await ws_tenant(websocket)
        url = await target(svc, caller.id, sandbox_id)
    except (APIError, NotFound) as e:
        await websocket.close(code=4404 if isinstance(e, NotFound) else 4000 + e.status,
                              reason=str(e)[:120])  # fmt: skip
        return
    await websocket.accept()
    ws_url = url.replace("http://", "ws://", 1) + "/exec/ws"
    try:
        connection: AbstractAsyncContextManager[AsyncWebSocketSession] = aconnect_ws(
            ws_url, svc.workers.http, max_message_size_bytes=1 << 20
        )
        async with connection as up:
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

    tasks = [asyncio.ensure_future(downstream()), asyncio.ensure_future(upstream())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(
                asyncio.CancelledError, UpstreamDisconnect, WebSocketDisconnect, HTTPXWSException
            ):
                await task


@router.get("/files", response_class=StreamingResponse)
async def download(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> StreamingResponse:
    url = await target(svc, caller.id, sandbox_id)
    return await relay(svc, "GET", f"{url}/files", "application/octet-stream",
                        params={"path": path})  # fmt: skip


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
    url = await target(svc, caller.id, sandbox_id)
    params = {"path": path, "mode": mode, "make_parents": str(make_parents).lower()}
    async with svc.workers.stream(
        "PUT", f"{url}/files", params=params, content=request.stream()
    ) as resp:
        return WriteResult.model_validate_json(await resp.aread())


@router.get("/files/list", response_model=FileList)
async def list_files(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> FileList:
    url = await target(svc, caller.id, sandbox_id)
    return FileList.model_validate(
        await svc.workers.call("GET", f"{url}/files/list", params={"path": path})
    )


@router.get("/files/stat", response_model=FileEntry)
async def stat_file(sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller) -> FileEntry:
    url = await target(svc, caller.id, sandbox_id)
    return FileEntry.model_validate(
        await svc.workers.call("GET", f"{url}/files/stat", params={"path": path})
    )


@router.delete("/files", status_code=204)
async def remove_file(
    sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller, recursive: bool = False
) -> Response:
    url = await target(svc, caller.id, sandbox_id)
    params = {"path": path, "recursive": str(recursive).lower()}
    await svc.workers.call("DELETE", f"{url}/files", params=params)
    return Response(status_code=204)


@router.post("/files/mkdir", response_model=FileEntry)
async def make_dir(
    sandbox_id: str, path: AbsPath, svc: Svc, caller: Caller, parents: bool = False
) -> FileEntry:
    url = await target(svc, caller.id, sandbox_id)
    params = {"path": path, "parents": str(parents).lower()}
    return FileEntry.model_validate(
        await svc.workers.call("POST", f"{url}/files/mkdir", params=params)
    )

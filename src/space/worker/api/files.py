"""Worker routes for a VM's files (docs/worker-api.md): streamed both ways through its agent,
never held whole."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from space.worker.api.bodies import Problem
from space.worker.api.models import MAX_PATH, NDJSON

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI


def abs_path(request: Request, name: str = "path") -> str:
    path = request.query_params.get(name, "")
    if not path.startswith("/") or "\0" in path or len(path) > MAX_PATH:
        raise Problem(400, f"{name!r} must be an absolute path (got {path!r})")
    return path


def flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no", ""):
        return False
    raise Problem(400, f"{name!r} must be true or false (got {value!r})")


def _line(event: dict[str, object]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def file_mode(request: Request) -> int:
    value = request.query_params.get("mode", "420")
    try:
        mode = int(value, 0) if value.startswith("0o") else int(value)
    except ValueError:
        raise Problem(400, f"'mode' must be a number such as 420 (0o644), got {value!r}") from None
    if not 0 <= mode <= 0o7777:
        raise Problem(400, f"'mode' must be between 0 and 4095 (0o7777), got {mode}")
    return mode


class FileRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api

    async def download(self, request: Request) -> Response:
        path = abs_path(request)
        chunks = cast(AsyncGenerator[bytes, None], (await self.api._agent(request)).iter_file(path))
        # The first chunk (or the agent's error) before the answer starts, so that a missing
        # file is a 404 and not a broken 200.
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = b""

        async def body() -> AsyncIterator[bytes]:
            try:
                if first:
                    yield first
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()

        return StreamingResponse(body(), media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        path, mode = abs_path(request), file_mode(request)
        make_parents = flag(request, "make_parents", False)
        agent = await self.api._agent(request)
        size = await agent.write_file(path, request.stream(), mode=mode, make_parents=make_parents)
        return JSONResponse({"size": size})

    async def list_dir(self, request: Request) -> Response:
        path = abs_path(request)
        return JSONResponse({"entries": await (await self.api._agent(request)).list_dir(path)})

    async def stat(self, request: Request) -> Response:
        path = abs_path(request)
        return JSONResponse(await (await self.api._agent(request)).stat(path))

    async def remove(self, request: Request) -> Response:
        path, recursive = abs_path(request), flag(request, "recursive", False)
        await (await self.api._agent(request)).remove(path, recursive=recursive)
        return Response(status_code=204)

    async def rename(self, request: Request) -> Response:
        path, overwrite = abs_path(request), flag(request, "overwrite", False)
        to = abs_path(request, "to")
        agent = await self.api._agent(request)
        return JSONResponse(await agent.rename(path, to, overwrite=overwrite))

    async def watch(self, request: Request) -> Response:
        """NDJSON: {"type": "watching"} once the watch is set (or the error, before the
        answer starts), then one line per event; leaving the stream stops the watch."""
        path, recursive = abs_path(request), flag(request, "recursive", False)
        events = (await self.api._agent(request)).watch(path, recursive=recursive)
        first = await anext(events)

        async def body() -> AsyncIterator[bytes]:
            try:
                yield _line(first)
                async for event in events:
                    yield _line(event)
            finally:
                await events.aclose()

        return StreamingResponse(body(), media_type=NDJSON)

    async def mkdir(self, request: Request) -> Response:
        path, parents = abs_path(request), flag(request, "parents", True)
        agent = await self.api._agent(request)
        return JSONResponse(await agent.call("mkdir", path=path, parents=parents))


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = FileRoutes(api)
    files = "/vms/{vm_id}/files"
    return [
        Route(files, r.download, methods=["GET"]),
        Route(files, r.upload, methods=["PUT"]),
        Route(files, r.remove, methods=["DELETE"]),
        Route(f"{files}/list", r.list_dir, methods=["GET"]),
        Route(f"{files}/stat", r.stat, methods=["GET"]),
        Route(f"{files}/mkdir", r.mkdir, methods=["POST"]),
        Route(f"{files}/rename", r.rename, methods=["POST"]),
        Route(f"{files}/watch", r.watch, methods=["GET"]),
    ]

"""Worker routes for a VM's processes (docs/worker-api.md): start one in the background, list
them, follow one (NDJSON, or both ways over a WebSocket), give it input, signal it, resize its
terminal. A process is named in the path by its pid or by its tag."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from space.worker.agent_client import AgentClient, ExecProcess
from space.worker.api.bodies import Problem, read_body
from space.worker.api.exec import agent_options, exec_events, ws_session, ws_start
from space.worker.api.models import (
    NDJSON,
    ExecRequest,
    ProcessInfo,
    ProcessList,
    ProcessSignal,
    TerminalSize,
    check_tag,
)

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI

MAX_STDIN = 16 << 20  # bytes of input in one call


def process_ref(conn: Request | WebSocket) -> dict[str, Any]:
    """{"pid": n} or {"tag": t} from the path (400 for anything else)."""
    ref = str(conn.path_params["ref"])
    if ref.isdigit():
        return {"pid": int(ref)}
    try:
        return {"tag": check_tag(ref)}
    except ValueError as e:
        raise Problem(400, f"{ref[:80]!r}: name a process by its pid or its tag ({e})") from None


class ProcessRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api

    async def _agent(self, conn: Request | WebSocket) -> AgentClient:
        return (await self.api.manager.agent(self.api._vm_id(conn)))[1]

    async def _find(self, request: Request) -> ProcessInfo:
        ref = process_ref(request)
        agent = await self._agent(request)
        for entry in await agent.processes():
            info = ProcessInfo.model_validate(entry)
            if info.pid == ref.get("pid") or (info.tag is not None and info.tag == ref.get("tag")):
                return info
        raise Problem(404, f"no process started in this sandbox has {_what(ref)}")

    async def start(self, request: Request) -> Response:
        body = await read_body(ExecRequest, request)
        options = {**agent_options(body), "pty": body.pty, "rows": body.rows, "cols": body.cols}
        options.pop("background")
        started = await self.api.manager.start_process(
            self.api._vm_id(request), body.command, **options
        )
        info = ProcessInfo.model_validate(started)
        if body.stdin:
            await self._control(request, {"pid": info.pid}, stdin=body.stdin,
                                eof=not body.keep_stdin)  # fmt: skip
        return JSONResponse(info.model_dump(mode="json"), 201)

    async def list(self, request: Request) -> Response:
        listed = await (await self._agent(request)).processes()
        return JSONResponse(ProcessList.model_validate({"processes": listed}).model_dump())

    async def get(self, request: Request) -> Response:
        return JSONResponse((await self._find(request)).model_dump(mode="json"))

    async def output(self, request: Request) -> Response:
        """Follow a process: what it kept first (unless ?replay=false), then until it ends."""
        replay = request.query_params.get("replay", "true") != "false"
        agent = await self._agent(request)
        proc = await agent.attach(**process_ref(request), replay=replay)
        return StreamingResponse(exec_events(proc, None), media_type=NDJSON)

    async def follow_ws(self, ws: WebSocket) -> None:
        """As the exec WebSocket, without its first message: stdin up, output down."""
        await ws.accept()

        async def attach() -> ExecProcess:
            replay = ws.query_params.get("replay", "true") != "false"
            return await (await self._agent(ws)).attach(**process_ref(ws), replay=replay)

        if proc := await ws_start(ws, attach()):
            await ws_session(ws, proc, None)

    async def stdin(self, request: Request) -> Response:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_STDIN:
                raise Problem(413, f"more than {MAX_STDIN} bytes of input in one call")
        eof = request.query_params.get("eof") == "true"
        await self._control(request, process_ref(request), stdin=bytes(data), eof=eof)
        return Response(status_code=204)

    async def signal(self, request: Request) -> Response:
        body = await read_body(ProcessSignal, request)
        await self._control(request, process_ref(request), signal=body.signal)
        return Response(status_code=204)

    async def resize(self, request: Request) -> Response:
        body = await read_body(TerminalSize, request)
        await self._control(request, process_ref(request), resize=(body.rows, body.cols))
        return Response(status_code=204)

    async def kill(self, request: Request) -> Response:
        await self._control(request, process_ref(request), signal=signal.SIGKILL)
        return Response(status_code=204)

    async def _control(self, request: Request, ref: dict[str, Any], **what: Any) -> None:
        agent = await self._agent(request)
        await agent.control(**ref, **{k: v for k, v in what.items() if v})  # no empty input


def _what(ref: dict[str, Any]) -> str:
    return f"pid {ref['pid']}" if "pid" in ref else f"tag {ref['tag']!r}"


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = ProcessRoutes(api)
    base = "/vms/{vm_id}/processes"
    one = base + "/{ref}"
    return [
        Route(base, r.start, methods=["POST"]),
        Route(base, r.list, methods=["GET"]),
        Route(one, r.get, methods=["GET"]),
        Route(one, r.kill, methods=["DELETE"]),
        Route(one + "/output", r.output, methods=["GET"]),
        WebSocketRoute(one + "/ws", r.follow_ws),
        Route(one + "/stdin", r.stdin, methods=["POST"]),
        Route(one + "/signal", r.signal, methods=["POST"]),
        Route(one + "/resize", r.resize, methods=["POST"]),
    ]

"""Worker routes for commands in a VM (docs/worker-api.md): NDJSON over HTTP, or both ways
over a WebSocket (with a PTY if asked); and byte streams to a port the guest listens on."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from space.worker.agent_client import AgentConnectionLost, AgentError, ExecProcess, ExecResult
from space.worker.api import tcp
from space.worker.api.bodies import Problem, parse, read_body
from space.worker.api.errors import AGENT_STATUS, as_problem
from space.worker.api.models import NDJSON, ExecRequest
from space.worker.sandboxes import VMManagerError
from space.worker.vmm.base import VMMError

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI

WS_FIRST_MESSAGE_S = 30.0
STDOUT_TAG, STDERR_TAG = b"\x01", b"\x02"
WS_FRAME = 32 << 10  # output per message; WebSocket clients often refuse messages over 64 KiB


class ExecRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api

    async def exec(self, request: Request) -> Response:
        body = await read_body(ExecRequest, request)
        if body.pty:
            raise Problem(400, "a PTY needs the interactive WebSocket: /vms/{id}/exec/ws")
        try:
            proc = await self.api.manager.exec(
                self.api._vm_id(request), body.command, env=body.env, cwd=body.cwd, user=body.user,
                timeout=body.timeout, stdin=body.stdin is not None,
            )  # fmt: skip
        except AgentConnectionLost:
            raise
        except AgentError as e:
            # The agent refused to start it (no such executable, user, directory): that is
            # the command's outcome, told as the stream's one event.
            return StreamingResponse(iter([_line(_error_event(e))]), media_type=NDJSON)
        return StreamingResponse(_exec_events(proc, body.stdin), media_type=NDJSON)

    async def exec_ws(self, ws: WebSocket) -> None:
        """First text message: the exec body plus pty/rows/cols; then stdin up, output down.

        Client → worker: binary = stdin; text `{"eof": true}`, `{"signal": n}`,
        `{"resize": [rows, cols]}`. Worker → client: binary frames tagged 1 (stdout) or
        2 (stderr), text events start/exit/error. A malformed control message is answered
        with an error event and otherwise ignored; the process goes on.
        """
        await ws.accept()
        try:
            first = await asyncio.wait_for(ws.receive(), WS_FIRST_MESSAGE_S)
            if first["type"] == "websocket.disconnect":
                return
            if first.get("text") is None:
                raise Problem(400, "the first message must be the exec request as JSON text")
            body = parse(ExecRequest, first["text"])
            proc = await self.api.manager.exec(
                self.api._vm_id(ws), body.command, env=body.env, cwd=body.cwd, user=body.user,
                timeout=body.timeout, stdin=True, pty=body.pty, rows=body.rows, cols=body.cols,
            )  # fmt: skip
        except TimeoutError:
            await _ws_fail(ws, Problem(408, f"no exec request within {WS_FIRST_MESSAGE_S:.0f}s"))
            return
        except (Problem, VMManagerError, AgentConnectionLost, VMMError) as e:
            await _ws_fail(ws, as_problem(e))
            return
        except AgentError as e:
            await _ws_fail(ws, e)
            return
        try:
            await ws.send_json({"type": "start", "pid": proc.pid})
        except WebSocketDisconnect:
            await _kill(proc)
            return
        if body.stdin:
            with contextlib.suppress(AgentError):  # a lost agent shows in the output's end
                await proc.write(body.stdin)
        output = asyncio.ensure_future(_ws_output(ws, proc))
        control = asyncio.ensure_future(_ws_input(ws, proc))
        try:
            await asyncio.wait([output, control], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not (output.done() and output.exception() is None):
                await _kill(proc)  # the client left: nobody wants the process any more
            control.cancel()
            for task in (control, output):
                with contextlib.suppress(
                    asyncio.CancelledError, WebSocketDisconnect, RuntimeError, AgentError
                ):
                    await task
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the peer may be gone
            await ws.close()

    async def tcp_ws(self, ws: WebSocket) -> None:
        """Bytes both ways to a port the guest listens on (ingress); see `tcp.bridge`."""
        try:
            agent = (await self.api.manager.agent(self.api._vm_id(ws)))[1]
        except (VMManagerError, AgentConnectionLost, VMMError) as e:
            await ws.accept()
            await _ws_fail(ws, as_problem(e))
            return
        await tcp.bridge(ws, agent, int(ws.path_params["port"]))


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = ExecRoutes(api)
    vm = "/vms/{vm_id}"
    return [
        Route(f"{vm}/exec", r.exec, methods=["POST"]),
        WebSocketRoute(f"{vm}/exec/ws", r.exec_ws),
        WebSocketRoute(f"{vm}/tcp/{{port:int}}", r.tcp_ws),
    ]


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _exit_event(result: ExecResult) -> dict[str, Any]:
    return {
        "type": "exit",
        "exit_code": result.exit_code,
        "signal": result.signal,
        "timed_out": result.timed_out,
        "duration_ms": result.duration_ms,
    }


def _error_event(e: AgentError | Problem) -> dict[str, Any]:
    if isinstance(e, Problem):
        code = HTTPStatus(e.status).phrase.lower().replace(" ", "_")
        return {"type": "error", "code": code, "message": e.detail, "status": e.status}
    return {"type": "error", "code": e.code, "message": e.message}


async def _kill(proc: ExecProcess) -> None:
    """Ends a process nobody listens to any more, so its channel closes too."""
    proc.discard()
    with contextlib.suppress(AgentError):
        await proc.signal(signal.SIGKILL)


async def _exec_events(proc: ExecProcess, stdin: bytes | None) -> AsyncIterator[bytes]:
    feeder = asyncio.ensure_future(_feed(proc, stdin)) if stdin is not None else None
    finished = False
    try:
        yield _line({"type": "start", "pid": proc.pid})
        async for stream, data in proc:
            yield _line({"type": stream, "data": base64.b64encode(data).decode()})
        result = await proc.wait()
        finished = True
        yield _line(_exit_event(result))
    except AgentError as e:
        finished = True  # the connection is gone: there is nobody left to signal
        yield _line(_error_event(e))
    finally:
        if feeder is not None:
            feeder.cancel()
        if not finished:
            await _kill(proc)


async def _feed(proc: ExecProcess, data: bytes) -> None:
    with contextlib.suppress(AgentError):
        await proc.write(data)
        await proc.close_stdin()


async def _ws_fail(ws: WebSocket, e: AgentError | Problem) -> None:
    status = e.status if isinstance(e, Problem) else AGENT_STATUS.get(e.code, 502)
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await ws.send_json(_error_event(e))
        await ws.close(code=4000 + status)


async def _ws_output(ws: WebSocket, proc: ExecProcess) -> None:
    try:
        async for stream, data in proc:
            tag = STDOUT_TAG if stream == "stdout" else STDERR_TAG
            for i in range(0, len(data), WS_FRAME):
                await ws.send_bytes(tag + data[i : i + WS_FRAME])
        await ws.send_json(_exit_event(await proc.wait()))
    except AgentError as e:
        await ws.send_json(_error_event(e))


async def _ws_input(ws: WebSocket, proc: ExecProcess) -> None:
    """Until the client leaves: its stdin and control messages, passed to the process."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            await proc.write(message["bytes"])
            continue
        try:
            ctl = json.loads(message.get("text") or "")
            if not isinstance(ctl, dict):
                raise ValueError("not an object")
            if ctl.get("eof") is True:
                await proc.close_stdin()
            elif isinstance(ctl.get("signal"), int) and 0 < ctl["signal"] < 65:
                await proc.signal(ctl["signal"])
            elif _is_size(ctl.get("resize")):
                await proc.resize(*ctl["resize"])
            else:
                raise ValueError(f"unknown control message {ctl!r}")
        except ValueError as e:
            await ws.send_json({
                "type": "error", "code": "invalid",
                "message": f"{e}; send {{\"eof\": true}}, {{\"signal\": n}} or "
                           "{\"resize\": [rows, cols]}",
            })  # fmt: skip


def _is_size(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and 0 < v <= 1000 for v in value)
    )

"""Worker routes for commands in a VM (docs/worker-api.md): NDJSON over HTTP, or both ways
over a WebSocket (with a PTY if asked); and byte streams to a port the guest listens on."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Awaitable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

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

T = TypeVar("T")
WS_FIRST_MESSAGE_S = 30.0
STDOUT_TAG, STDERR_TAG = b"\x01", b"\x02"
WS_FRAME = 32 << 10  # output per message; WebSocket clients often refuse messages over 64 KiB
WS_INPUT_BYTES = 1 << 20  # of input read ahead of a process slow to take it
WS_INPUT_DRAIN_S = 10.0  # for what a client sent before it left to reach a process that runs on


class ExecRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api

    async def exec(self, request: Request) -> Response:
        body = await read_body(ExecRequest, request)
        options = agent_options(body)
        if body.pty:
            # A background process's terminal takes its input through its process routes.
            if not body.background:
                raise Problem(400, "a PTY needs the interactive WebSocket (/vms/{id}/exec/ws) "
                                   "or a background process")  # fmt: skip
            options.update(pty=True, rows=body.rows, cols=body.cols)
        try:
            proc = await self.api.manager.exec(self.api._vm_id(request), body.command, **options)
        except AgentConnectionLost:
            raise
        except AgentError as e:
            # The agent refused to start it (no such executable, user, directory): that is
            # the command's outcome, told as the stream's one event.
            return StreamingResponse(iter([_line(_error_event(e))]), media_type=NDJSON)
        events = exec_events(proc, body.stdin, close_stdin=not body.keep_stdin)
        return StreamingResponse(events, media_type=NDJSON)

    async def exec_ws(self, ws: WebSocket) -> None:
        """First text message: the exec body plus pty/rows/cols; then stdin up, output down.

        Client → worker: binary = stdin; text `{"eof": true}`, `{"signal": n}`,
        `{"resize": [rows, cols]}`. Worker → client: binary frames tagged 1 (stdout) or
        2 (stderr), text events start/exit/error. A malformed control message is answered
        with an error event and otherwise ignored; the process goes on.
        """
        await ws.accept()

        async def start() -> tuple[ExecProcess, bytes | None] | None:
            try:
                first = await asyncio.wait_for(ws.receive(), WS_FIRST_MESSAGE_S)
            except TimeoutError:
                raise Problem(408, f"no exec request within {WS_FIRST_MESSAGE_S:.0f}s") from None
            if first["type"] == "websocket.disconnect":
                return None
            if first.get("text") is None:
                raise Problem(400, "the first message must be the exec request as JSON text")
            body = parse(ExecRequest, first["text"])
            proc = await self.api.manager.exec(
                self.api._vm_id(ws), body.command, **{**agent_options(body), "stdin": True},
                pty=body.pty, rows=body.rows, cols=body.cols,
            )  # fmt: skip
            return proc, body.stdin

        if started := await ws_start(ws, start()):
            await ws_session(ws, *started)

    async def tcp_ws(self, ws: WebSocket) -> None:
        """Bytes both ways to a port the guest listens on (ingress); see `tcp.bridge`."""
        vm_id = self.api._vm_id(ws)
        try:
            agent = (await self.api.manager.agent(vm_id))[1]
        except (VMManagerError, AgentConnectionLost, VMMError) as e:
            await ws.accept()
            await ws_fail(ws, as_problem(e))
            return
        use = tcp.Use(self.api.activity, vm_id)
        await tcp.bridge(ws, agent, int(ws.path_params["port"]), use)


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = ExecRoutes(api)
    vm = "/vms/{vm_id}"
    return [
        Route(f"{vm}/exec", r.exec, methods=["POST"]),
        WebSocketRoute(f"{vm}/exec/ws", r.exec_ws),
        WebSocketRoute(f"{vm}/tcp/{{port:int}}", r.tcp_ws),
    ]


def agent_options(body: ExecRequest) -> dict[str, Any]:
    """What of an exec request the agent is given (the command aside)."""
    return {
        "env": body.env, "cwd": body.cwd, "user": body.user, "timeout": body.timeout,
        "stdin": body.stdin is not None or body.keep_stdin, "background": body.background,
        "tag": body.tag,
    }  # fmt: skip


async def ws_session(ws: WebSocket, proc: ExecProcess, stdin: bytes | None) -> None:
    """A followed process over an accepted WebSocket (see `exec_ws`), until it ends or the
    client leaves (see `leave`)."""
    try:
        await ws.send_json(_start_event(proc))
    except WebSocketDisconnect:
        await leave(proc)
        return
    output = asyncio.ensure_future(_ws_output(ws, proc))
    control = asyncio.ensure_future(_ws_input(ws, proc, stdin))
    try:
        await asyncio.wait([output, control], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not (output.done() and output.exception() is None):
            if not proc.owned or proc.background:
                # It runs on without the client: what the client sent still reaches it.
                proc.discard()
                await asyncio.wait([control], timeout=WS_INPUT_DRAIN_S + 1)
            await leave(proc)
        control.cancel()
        for task in (control, output):
            with contextlib.suppress(
                asyncio.CancelledError, WebSocketDisconnect, RuntimeError, AgentError
            ):
                await task
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the peer may be gone
        await ws.close()


def _start_event(proc: ExecProcess) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "start", "pid": proc.pid}
    if proc.tag is not None:
        event["tag"] = proc.tag
    if proc.dropped:
        event["dropped"] = proc.dropped
    return event


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
    return {"type": "error", "code": e.code, "message": e.message,
            "status": AGENT_STATUS.get(e.code, 502)}  # fmt: skip


async def leave(proc: ExecProcess) -> None:
    """Nobody follows the process here any more: one this exec started in the foreground is
    killed (so its channel closes too); a background one, or one attached to, runs on."""
    proc.discard()
    with contextlib.suppress(AgentError):
        if proc.owned and not proc.background:
            await proc.signal(signal.SIGKILL)
        else:
            await proc.detach()


async def exec_events(
    proc: ExecProcess, stdin: bytes | None, *, close_stdin: bool = True
) -> AsyncIterator[bytes]:
    """A followed process as NDJSON: start, its output, then exit (or error)."""
    feeder = None
    if stdin is not None:
        feeder = asyncio.ensure_future(_feed(proc, stdin, close_stdin))
    finished = False
    try:
        yield _line(_start_event(proc))
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
            await leave(proc)


async def _feed(proc: ExecProcess, data: bytes, close: bool) -> None:
    with contextlib.suppress(AgentError):
        if await proc.write(data) and close:
            await proc.close_stdin()


async def ws_start(ws: WebSocket, starting: Awaitable[T]) -> T | None:
    """What `starting` gives, or None once its failure was told to the client, which is gone."""
    try:
        return await starting
    except (Problem, VMManagerError, AgentConnectionLost, VMMError) as e:
        await ws_fail(ws, as_problem(e))
    except AgentError as e:
        await ws_fail(ws, e)
    return None


async def ws_fail(ws: WebSocket, e: AgentError | Problem) -> None:
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


class _Input:
    """A process's input from a WebSocket, written in order by a task of its own, so a process
    slow to take it (`ExecProcess.write` waits) holds back its input and not a signal or a
    resize sent after it; at most WS_INPUT_BYTES wait here before the client is read no more."""

    def __init__(self, proc: ExecProcess) -> None:
        self._items: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: its end
        self._waiting = 0
        self._room = asyncio.Event()
        self._room.set()
        self._writer = asyncio.ensure_future(self._write(proc))

    async def put(self, data: bytes | None) -> None:
        await self._room.wait()
        if self._writer.done():
            return  # the process's channel failed: nothing reaches it any more
        self._items.put_nowait(data)
        self._count(len(data or b""))

    def _count(self, n: int) -> None:
        self._waiting += n
        if self._waiting >= WS_INPUT_BYTES:
            self._room.clear()
        else:
            self._room.set()

    async def _write(self, proc: ExecProcess) -> None:
        try:
            while True:
                data = await self._items.get()
                try:
                    await (proc.close_stdin() if data is None else proc.write(data))
                finally:
                    self._count(-len(data or b""))
                    self._items.task_done()
        finally:  # its channel failed (or the session ended): what waits is dropped
            while not self._items.empty():
                self._items.get_nowait()
                self._items.task_done()
            self._room.set()

    async def drain(self, timeout: float) -> None:
        """Until what was put is written (or `timeout`)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._items.join(), timeout)

    async def close(self) -> None:
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, AgentError):
            await self._writer


async def _ws_input(ws: WebSocket, proc: ExecProcess, stdin: bytes | None) -> None:
    """Until the client leaves: its stdin and control messages, passed to the process. What
    it sent still reaches a process that runs on after it (a background or attached one)."""
    inputs = _Input(proc)
    try:
        if stdin:
            await inputs.put(stdin)
        await _ws_messages(ws, proc, inputs)
        if not proc.owned or proc.background:
            await inputs.drain(WS_INPUT_DRAIN_S)
    finally:
        await inputs.close()


async def _ws_messages(ws: WebSocket, proc: ExecProcess, inputs: _Input) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            await inputs.put(message["bytes"])
            continue
        try:
            ctl = json.loads(message.get("text") or "")
            if not isinstance(ctl, dict):
                raise ValueError("not an object")
            if ctl.get("eof") is True:
                await inputs.put(None)
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

"""The worker's HTTP API server (docs/worker-api.md): VM lifecycle for the controller, exec and
file streams for the API server, all behind the deployment's worker secret.

Bodies are checked against the wire models (`space.worker.api.models`) and refused with a
problem+json 400 that names what was wrong; the VM work itself is `VMManager`'s. Lifecycle calls
must carry the leader's epoch, which the worker's `Fence` checks (412 when stale). Exec streams
as NDJSON over HTTP, or both ways over a WebSocket (with a PTY if asked); files stream in both
directions without being held whole.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import re
import signal
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from http import HTTPStatus
from typing import Any, cast

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from space.gateway.client import GatewayError
from space.gateway.policy import Policy
from space.identity import TLSFiles
from space.logs import RequestLog
from space.problem import problem
from space.worker import ksm
from space.worker.agent_client import (
    AgentClient,
    AgentConnectionLost,
    AgentError,
    ExecProcess,
    ExecResult,
)
from space.worker.api import checkpoints, tcp
from space.worker.api.activity import Activity, ActivityMiddleware
from space.worker.api.bodies import Problem, parse, read_body
from space.worker.api.models import (
    EPOCH_HEADER,
    MAX_PATH,
    NDJSON,
    BuildRequest,
    ClaimVM,
    CreateVM,
    ExecRequest,
    Health,
    Reconcile,
    Reconciled,
    Resources,
    VMCreated,
    VMReport,
    VMStats,
    VMStatusAnswer,
)
from space.worker.builds import Build, BuildRefused, Builds
from space.worker.fence import Fence, StaleEpoch
from space.worker.network import NetworkError
from space.worker.sandboxes import (
    InvalidArgument,
    NoRoom,
    TemplateInUse,
    TemplateNotFound,
    Unavailable,
    VMManager,
    VMManagerError,
    VMNotFound,
    VolumeInUse,
    VolumeMount,
    WrongState,
    usage,
)
from space.worker.sandboxes.capacity import meminfo_mib
from space.worker.sandboxes.records import EPOCH_FILE
from space.worker.vmm.base import VMMError

log = logging.getLogger(__name__)

VM_PATH = re.compile(r"^/vms/([A-Za-z0-9_-]{1,64})(?:/|$)")
QUIET = frozenset({"/health"})  # the controller's probes, every second
WS_FIRST_MESSAGE_S = 30.0
STDOUT_TAG, STDERR_TAG = b"\x01", b"\x02"
WS_FRAME = 32 << 10  # output per message; WebSocket clients often refuse messages over 64 KiB

MANAGER_STATUS: dict[type[VMManagerError], int] = {
    InvalidArgument: 400,
    VMNotFound: 404,
    TemplateNotFound: 404,
    WrongState: 409,
    VolumeInUse: 409,
    TemplateInUse: 409,
    NoRoom: 507,
    Unavailable: 503,
}
AGENT_STATUS = {
    "invalid": 400,
    "is_a_directory": 400,
    "not_a_directory": 400,
    "permission_denied": 403,
    "not_found": 404,
    "exists": 409,
    "not_empty": 409,
    "no_space": 507,
}  # any other code (lost, timeout, internal, unauthenticated): the guest agent failed, 502


def as_problem(e: Exception) -> Problem:
    """What one of our errors means to a caller of the API."""
    if isinstance(e, Problem):
        return e
    if isinstance(e, VMManagerError):
        status = next(s for cls, s in MANAGER_STATUS.items() if isinstance(e, cls))
        return Problem(status, str(e), state=getattr(e, "state", None))
    if isinstance(e, AgentConnectionLost):
        return Problem(502, f"the guest agent failed: {e.message}", code=e.code)
    if isinstance(e, AgentError):
        return Problem(AGENT_STATUS.get(e.code, 502), e.message, code=e.code)
    if isinstance(e, VMMError):
        return Problem(502, f"the VM failed: {e}")
    if isinstance(e, ClientDisconnect):
        return Problem(400, "the client went away before its request body was complete")
    if isinstance(e, GatewayError | NetworkError):
        return Problem(502, f"the sandbox network failed: {e}")
    raise TypeError(f"no problem for {type(e).__name__}")


# --- query parameters -------------------------------------------------------------------------


def abs_path(request: Request) -> str:
    path = request.query_params.get("path", "")
    if not path.startswith("/") or "\0" in path or len(path) > MAX_PATH:
        raise Problem(400, f"'path' must be an absolute path (got {path!r})")
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


def file_mode(request: Request) -> int:
    value = request.query_params.get("mode", "420")
    try:
        mode = int(value, 0) if value.startswith("0o") else int(value)
    except ValueError:
        raise Problem(400, f"'mode' must be a number such as 420 (0o644), got {value!r}") from None
    if not 0 <= mode <= 0o7777:
        raise Problem(400, f"'mode' must be between 0 and 4095 (0o7777), got {mode}")
    return mode


# --- authentication ---------------------------------------------------------------------------


class BearerAuth:
    """Every request and WebSocket needs `Authorization: Bearer <worker secret>`."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        if not secret:
            raise ValueError("the worker secret must not be empty")
        self.app = app
        self.secret = secret.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = bytes(value).partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.secret)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        refusal = problem(401, "a valid worker secret is required (Authorization: Bearer …)",
                          headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get(
            "extensions", {}
        ):
            await send({"type": "websocket.close", "code": 4401})
            return
        await refusal(scope, receive, send)


# --- routes -----------------------------------------------------------------------------------


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


class WorkerAPI:
    def __init__(
        self, manager: VMManager, fence: Fence, problems: Callable[[], list[str]], instance: str
    ) -> None:
        self.manager = manager
        self.builds = Builds(manager)
        self.fence = fence
        self.problems = problems  # why the worker cannot take work now (its gateway is down…)
        self.instance = instance
        self.activity = Activity()

    def _vm_id(self, conn: Request | WebSocket) -> str:
        return str(conn.path_params["vm_id"])

    async def _agent(self, request: Request) -> AgentClient:
        return (await self.manager.agent(self._vm_id(request)))[1]

    def _fenced(self, request: Request, required: bool = True) -> None:
        """Check the caller's leader epoch: lifecycle calls must carry one that is current."""
        raw = request.headers.get(EPOCH_HEADER)
        if raw is None:
            if required:
                raise Problem(428, f"lifecycle calls need the leader's epoch ({EPOCH_HEADER})",
                              code="epoch_required")  # fmt: skip
            return
        if not raw.isdigit():
            raise Problem(400, f"{EPOCH_HEADER} must be a number, got {raw[:40]!r}")
        try:
            self.fence.check(int(raw))
        except StaleEpoch as e:
            raise Problem(412, str(e), code="stale_epoch") from None

    # --- lifecycle ---

    async def health(self, request: Request) -> Response:
        self._fenced(request, required=False)
        m = self.manager
        vms = [
            VMReport(id=sb.id, state=sb.state, reason=sb.reason,  # type: ignore[arg-type]
                     policy=m.policy_known(sb.id), crashed=sb.crashed,
                     rebooted=sb.boot == "reboot", idle_s=self.activity.idle_s(sb.id))
            for sb in m.vms()
        ]  # fmt: skip
        self.activity.forget({vm.id for vm in vms})
        used = m.capacity.with_reserved(m.held())
        problems = self.problems()
        health = Health(
            worker_id=m.worker_id, instance=self.instance, epoch=self.fence.epoch,
            healthy=not problems, problems=problems, vms=vms,
            capacity=Resources(vcpus=m.capacity.vcpus,
                               memory_mib=m.capacity.memory_mib - m.capacity.reserve_mib,
                               disk_mib=m.capacity.disk_limit_mib()),
            used=Resources(vcpus=used.vcpus, memory_mib=used.memory_mib,
                           disk_mib=used.disk_mib + m.volumes.growth_mib()),
            overhead_mib=m.capacity.overhead_mib,
            admit_memory=m.capacity.admit_memory,
            ksm_saved_mib=merged.saved_bytes >> 20 if (merged := ksm.figures()) else None,
            mem_available_mib=meminfo_mib("MemAvailable"),
            disk_free_mib=m.capacity.free_disk_mib(),
        )  # fmt: skip
        return JSONResponse(health.model_dump(mode="json"))

    async def create(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(CreateVM, request)
        if self.problems() and self.manager.egress is not None:
            raise Problem(503, f"this worker cannot start VMs now: {'; '.join(self.problems())}")
        sb = await self.manager.create(
            self._vm_id(request), body.template, body.vcpus, body.memory_mib, body.env,
            body.hostname, body.disk_mib, body.warm,
            [VolumeMount(**v.model_dump()) for v in body.volumes], body.network,
        )  # fmt: skip
        made = VMCreated(id=sb.id, state=sb.state, boot=sb.boot,  # type: ignore[arg-type]
                         took_ms=round(sb.took_ms, 3))  # fmt: skip
        return JSONResponse(made.model_dump(mode="json"))

    async def claim(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(ClaimVM, request)
        sb = await self.manager.claim(self._vm_id(request), body.env, body.network)
        return _state(sb.id, sb.state)

    async def set_network(self, request: Request) -> Response:
        self._fenced(request)
        policy = await read_body(Policy, request)
        await self.manager.set_policy(self._vm_id(request), policy)
        return Response(status_code=204)

    async def audit(self, request: Request) -> Response:
        after = request.query_params.get("after", "0")
        if not after.isdigit():
            raise Problem(400, "after must be an event number")
        self.manager.get(self._vm_id(request))  # 404 for VMs this worker does not have
        return JSONResponse({"items": await self.manager.audit(self._vm_id(request), int(after))})

    async def stats(self, request: Request) -> Response:
        sb = self.manager.get(self._vm_id(request))
        used = await usage.measure(sb, self.manager.network_of(sb.id))
        stats = VMStats(
            id=sb.id, state=sb.state, at=used.at, vcpus=sb.spec.vcpus,  # type: ignore[arg-type]
            memory_mib=sb.spec.memory_mib, cpu_seconds=used.cpu_seconds,
            memory_bytes=used.memory_bytes, disk_bytes=used.disk_bytes,
            net_rx_bytes=used.net_rx_bytes, net_tx_bytes=used.net_tx_bytes,
        )  # fmt: skip
        return JSONResponse(stats.model_dump(mode="json"))

    async def pause(self, request: Request) -> Response:
        self._fenced(request)
        sb = await self.manager.pause(self._vm_id(request))
        return _state(sb.id, sb.state)

    async def resume(self, request: Request) -> Response:
        self._fenced(request)
        sb = await self.manager.resume(self._vm_id(request))
        return _state(sb.id, sb.state)

    async def suspend(self, request: Request) -> Response:
        self._fenced(request)
        sb = await self.manager.suspend(self._vm_id(request))
        return _state(sb.id, sb.state)

    async def delete(self, request: Request) -> Response:
        self._fenced(request)
        await self.manager.delete(self._vm_id(request))
        return Response(status_code=204)

    async def delete_volume(self, request: Request) -> Response:
        self._fenced(request)
        await self.manager.delete_volume(str(request.path_params["volume_id"]))
        return Response(status_code=204)

    # --- templates ---

    async def start_build(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(BuildRequest, request)
        try:
            context = base64.b64decode(body.context, validate=True)
        except binascii.Error:
            raise Problem(400, "context must be base64 (of a tar archive)") from None
        try:
            build = self.builds.start(
                str(request.path_params["name"]), body.spec, context, body.environ,
                body.request_id,
            )  # fmt: skip
        except BuildRefused as e:
            raise Problem(400, str(e)) from None
        return JSONResponse(build.status(), status_code=202)

    def _build(self, request: Request) -> Build:
        build = self.builds.get(str(request.path_params["build_id"]))
        if build is None:
            raise Problem(404, f"no build {request.path_params['build_id']} on this worker")
        return build

    async def build_status(self, request: Request) -> Response:
        return JSONResponse(self._build(request).status())

    async def build_log(self, request: Request) -> Response:
        """The build's log, one line per line, following it until the build ends."""
        build = self._build(request)

        async def lines() -> AsyncIterator[bytes]:
            async for line in build.log.follow():
                yield (line + "\n").encode()

        return StreamingResponse(lines(), media_type="text/plain; charset=utf-8")

    async def delete_template(self, request: Request) -> Response:
        self._fenced(request)
        await self.manager.remove_template(str(request.path_params["name"]))
        return Response(status_code=204)

    async def reconcile(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(Reconcile, request)
        removed = Reconciled(removed=await self.manager.reconcile(body.keep))
        return JSONResponse(removed.model_dump())

    # --- exec ---

    async def exec(self, request: Request) -> Response:
        body = await read_body(ExecRequest, request)
        if body.pty:
            raise Problem(400, "a PTY needs the interactive WebSocket: /vms/{id}/exec/ws")
        try:
            proc = await self.manager.exec(
                self._vm_id(request), body.command, env=body.env, cwd=body.cwd, user=body.user,
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
            proc = await self.manager.exec(
                self._vm_id(ws), body.command, env=body.env, cwd=body.cwd, user=body.user,
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
            agent = (await self.manager.agent(self._vm_id(ws)))[1]
        except (VMManagerError, AgentConnectionLost, VMMError) as e:
            await ws.accept()
            await _ws_fail(ws, as_problem(e))
            return
        await tcp.bridge(ws, agent, int(ws.path_params["port"]))

    # --- files ---

    async def download(self, request: Request) -> Response:
        path = abs_path(request)
        chunks = cast(AsyncGenerator[bytes, None], (await self._agent(request)).iter_file(path))
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
        agent = await self._agent(request)
        size = await agent.write_file(path, request.stream(), mode=mode, make_parents=make_parents)
        return JSONResponse({"size": size})

    async def list_dir(self, request: Request) -> Response:
        path = abs_path(request)
        return JSONResponse({"entries": await (await self._agent(request)).list_dir(path)})

    async def stat(self, request: Request) -> Response:
        path = abs_path(request)
        return JSONResponse(await (await self._agent(request)).stat(path))

    async def remove(self, request: Request) -> Response:
        path, recursive = abs_path(request), flag(request, "recursive", False)
        await (await self._agent(request)).remove(path, recursive=recursive)
        return Response(status_code=204)

    async def mkdir(self, request: Request) -> Response:
        path, parents = abs_path(request), flag(request, "parents", True)
        agent = await self._agent(request)
        return JSONResponse(await agent.call("mkdir", path=path, parents=parents))


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


# --- the app ----------------------------------------------------------------------------------


async def _on_problem(request: Request, e: Exception) -> Response:
    p = as_problem(e)
    return problem(p.status, p.detail, **p.extra)


async def _on_http(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    return problem(e.status_code, str(e.detail), headers=e.headers)


async def _on_unexpected(request: Request, e: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=e)
    return problem(500, f"internal error ({type(e).__name__}); it has been logged")


def _state(vm_id: str, state: str) -> Response:
    return JSONResponse(VMStatusAnswer(id=vm_id, state=state).model_dump())  # type: ignore[arg-type]


def make_app(
    manager: VMManager,
    secret: str,
    fence: Fence,
    problems: Callable[[], list[str]] = list,
    instance: str = "",
) -> Starlette:
    api = WorkerAPI(manager, fence, problems, instance)
    vm = "/vms/{vm_id}"
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/reconcile", api.reconcile, methods=["POST"]),
        Route(vm, api.create, methods=["PUT"]),
        Route(vm, api.delete, methods=["DELETE"]),
        Route(f"{vm}/claim", api.claim, methods=["POST"]),
        Route(f"{vm}/network", api.set_network, methods=["PUT"]),
        Route(f"{vm}/audit", api.audit, methods=["GET"]),
        Route(f"{vm}/stats", api.stats, methods=["GET"]),
        Route("/volumes/{volume_id}", api.delete_volume, methods=["DELETE"]),
        Route("/templates/{name}/builds", api.start_build, methods=["POST"]),
        Route("/templates/{name}", api.delete_template, methods=["DELETE"]),
        Route("/builds/{build_id}", api.build_status, methods=["GET"]),
        Route("/builds/{build_id}/log", api.build_log, methods=["GET"]),
        Route(f"{vm}/pause", api.pause, methods=["POST"]),
        Route(f"{vm}/resume", api.resume, methods=["POST"]),
        Route(f"{vm}/suspend", api.suspend, methods=["POST"]),
        Route(f"{vm}/exec", api.exec, methods=["POST"]),
        WebSocketRoute(f"{vm}/exec/ws", api.exec_ws),
        WebSocketRoute(f"{vm}/tcp/{{port:int}}", api.tcp_ws),
        Route(f"{vm}/files", api.download, methods=["GET"]),
        Route(f"{vm}/files", api.upload, methods=["PUT"]),
        Route(f"{vm}/files", api.remove, methods=["DELETE"]),
        Route(f"{vm}/files/list", api.list_dir, methods=["GET"]),
        Route(f"{vm}/files/stat", api.stat, methods=["GET"]),
        Route(f"{vm}/files/mkdir", api.mkdir, methods=["POST"]),
        *checkpoints.routes(api),
    ]
    handlers = {
        cls: _on_problem
        for cls in (
            Problem,
            VMManagerError,
            AgentError,
            VMMError,
            ClientDisconnect,
            GatewayError,
            NetworkError,
        )
    }
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(BearerAuth, secret=secret),
            # Inside the authentication: only our own services' headers are believed.
            Middleware(RequestLog, sandbox_path=VM_PATH, trusted=True, quiet=QUIET),
            Middleware(ActivityMiddleware, activity=api.activity),
        ],
        exception_handlers={**handlers, HTTPException: _on_http, Exception: _on_unexpected},
    )


async def serve(
    manager: VMManager,
    secret: str,
    host: str,
    port: int,
    *,
    fence: Fence | None = None,
    problems: Callable[[], list[str]] = list,
    instance: str = "",
    tls: TLSFiles | None = None,
) -> None:
    """Serve the worker API until cancelled (or a SIGINT/SIGTERM), then shut down cleanly.
    With `tls`, it serves HTTPS and asks callers for a client certificate of the deployment's
    CA (mutual TLS between the control plane and its workers)."""
    fence = fence or Fence(manager.root / EPOCH_FILE)
    ssl_options: dict[str, Any] = {}
    if tls is not None:
        ssl_options = {"ssl_certfile": str(tls.cert), "ssl_keyfile": str(tls.key),
                       "ssl_ca_certs": str(tls.ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}  # fmt: skip
    config = uvicorn.Config(
        make_app(manager, secret, fence, problems, instance), host=host, port=port,
        log_level="warning", log_config=None, **ssl_options,
        lifespan="off", timeout_graceful_shutdown=5,
        ws="wsproto",  # the default implementation logs an error for every refused WebSocket
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    dropping = asyncio.ensure_future(_drop_closed_tls(server)) if tls is not None else None
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise
    finally:
        if dropping is not None:
            dropping.cancel()


async def _drop_closed_tls(server: uvicorn.Server) -> None:
    """Once the server stops: a TLS connection it closes waits for the peer's close_notify,
    which an idle pooled client never sends (asyncio waits up to 30 s), so every restart would
    last the whole graceful-shutdown time. Drop such a connection once all it had to send is
    sent."""
    while True:
        await asyncio.sleep(0.05)
        if not server.should_exit:
            continue
        for connection in list(server.server_state.connections):
            transport = getattr(connection, "transport", None)
            if (isinstance(transport, asyncio.Transport) and transport.is_closing()
                    and transport.get_write_buffer_size() == 0):  # fmt: skip
                transport.abort()

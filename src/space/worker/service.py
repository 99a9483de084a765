"""The worker's HTTP API (docs/worker-api.md): VM lifecycle for the controller, exec and file
streams for the API server, all behind the deployment's worker secret.

Bodies are checked here (pydantic) and refused with a problem+json 400 that names what was
wrong; the VM work itself is `VMManager`'s. Exec streams as NDJSON over HTTP, or both ways over
a WebSocket (with a PTY if asked); files stream in both directions without being held whole.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import signal
from collections.abc import AsyncGenerator, AsyncIterator
from http import HTTPStatus
from typing import Annotated, Any, TypeVar, cast

import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
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
from space.problem import problem
from space.worker.agent_client import (
    AgentClient,
    AgentConnectionLost,
    AgentError,
    ExecProcess,
    ExecResult,
)
from space.worker.builds import Build, BuildRefused, Builds
from space.worker.network import NetworkError
from space.worker.vmm.base import VMMError
from space.worker.vms import (
    VOLUME_ID,
    VOLUME_SLOTS,
    InvalidArgument,
    NoRoom,
    TemplateInUse,
    TemplateNotFound,
    VMManager,
    VMManagerError,
    VMNotFound,
    VolumeInUse,
    VolumeMount,
    WrongState,
)

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
HOSTNAME = r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,62})$"
TEMPLATE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
MAX_PATH = 4096
MAX_CONTEXT_B64 = 96 << 20  # a build context of up to 64 MiB (files to copy into a template)
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


class Problem(Exception):
    """An answer other than success, as problem+json."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.extra = extra


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


# --- bodies -----------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


EnvName = Annotated[str, Field(pattern=ENV_NAME)]
EnvValue = Annotated[str, Field(max_length=32768, pattern=r"^[^\x00]*$")]


class VolumeBody(Strict):
    id: str = Field(pattern=VOLUME_ID.pattern)
    size_mib: int = Field(ge=1, le=1 << 22)
    path: str = Field(pattern=r"^/[^\x00]*$", max_length=MAX_PATH)
    read_only: bool = False


class CreateBody(Strict):
    template: str = Field("base", pattern=TEMPLATE)
    vcpus: int = Field(1, ge=1, le=64)
    memory_mib: int = Field(256, ge=128, le=1 << 20)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    hostname: str | None = Field(None, pattern=HOSTNAME)
    disk_mib: int = Field(0, ge=0, le=1 << 20)
    warm: bool = False
    volumes: list[VolumeBody] = Field(default_factory=list, max_length=VOLUME_SLOTS)
    network: Policy | None = None  # what the gateway lets out (default: nothing)


class ClaimBody(Strict):
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    network: Policy | None = None


class BuildBody(Strict):
    spec: str = Field(min_length=1, max_length=1 << 20)
    context: str = Field("", max_length=MAX_CONTEXT_B64, description="base64 of a tar")
    environ: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=64)


class ExecBody(Strict):
    cmd: str | None = Field(None, min_length=1, pattern=r"^[^\x00]*$")
    argv: list[Annotated[str, Field(pattern=r"^[^\x00]*$")]] | None = Field(None, min_length=1)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=256)
    cwd: str | None = Field(None, pattern=r"^/[^\x00]*$", max_length=MAX_PATH)
    user: (
        Annotated[str, Field(min_length=1, max_length=64)] | Annotated[int, Field(ge=0)] | None
    ) = None
    timeout: float | None = Field(None, gt=0)
    stdin: bytes | None = Field(None, description="base64")
    pty: bool = False
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)

    @field_validator("stdin", mode="before")
    @classmethod
    def decode_stdin(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str):
            raise ValueError("stdin must be a base64 string")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("stdin is not valid base64") from None

    @model_validator(mode="after")
    def one_command(self) -> ExecBody:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell command) or 'argv' (a list)")
        return self

    @property
    def command(self) -> str | list[str]:
        return self.cmd if self.cmd is not None else list(self.argv or [])


class ReconcileBody(Strict):
    keep: list[str]


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes | str) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        errors = [
            {"loc": ".".join(str(x) for x in err["loc"]) or "body", "msg": err["msg"]}
            for err in e.errors(include_url=False)
        ]
        detail = "; ".join(f"{x['loc']}: {x['msg']}" for x in errors)
        raise Problem(400, f"invalid request body: {detail}", errors=errors) from None


async def read_body(model: type[M], request: Request) -> M:
    return parse(model, await request.body() or b"{}")


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
    def __init__(self, manager: VMManager) -> None:
        self.manager = manager
        self.builds = Builds(manager)

    def _vm_id(self, conn: Request | WebSocket) -> str:
        return str(conn.path_params["vm_id"])

    async def _agent(self, request: Request) -> AgentClient:
        return (await self.manager.agent(self._vm_id(request)))[1]

    # --- lifecycle ---

    async def health(self, request: Request) -> Response:
        vms = []
        for sb in self.manager.vms():
            entry: dict[str, Any] = {"id": sb.id, "state": sb.state,
                                     "policy": self.manager.policy_known(sb.id)}  # fmt: skip
            if sb.reason:
                entry["reason"] = sb.reason
            vms.append(entry)
        used_vcpus, used_mib = self.manager.used()
        return JSONResponse({
            "worker_id": self.manager.worker_id,
            "vms": vms,
            "capacity": {"vcpus": self.manager.capacity_vcpus,
                         "memory_mib": self.manager.capacity_memory_mib},
            "used": {"vcpus": used_vcpus, "memory_mib": used_mib},
        })  # fmt: skip

    async def create(self, request: Request) -> Response:
        body = await read_body(CreateBody, request)
        sb = await self.manager.create(
            self._vm_id(request), body.template, body.vcpus, body.memory_mib, body.env,
            body.hostname, body.disk_mib, body.warm,
            [VolumeMount(**v.model_dump()) for v in body.volumes], body.network,
        )  # fmt: skip
        return JSONResponse(
            {"id": sb.id, "state": sb.state, "boot": sb.boot, "took_ms": round(sb.took_ms, 3)}
        )

    async def claim(self, request: Request) -> Response:
        body = await read_body(ClaimBody, request)
        sb = await self.manager.claim(self._vm_id(request), body.env, body.network)
        return JSONResponse({"id": sb.id, "state": sb.state})

    async def set_network(self, request: Request) -> Response:
        policy = await read_body(Policy, request)
        await self.manager.set_policy(self._vm_id(request), policy)
        return Response(status_code=204)

    async def audit(self, request: Request) -> Response:
        after = request.query_params.get("after", "0")
        if not after.isdigit():
            raise Problem(400, "after must be an event number")
        self.manager.get(self._vm_id(request))  # 404 for VMs this worker does not have
        return JSONResponse({"items": await self.manager.audit(self._vm_id(request), int(after))})

    async def pause(self, request: Request) -> Response:
        sb = await self.manager.pause(self._vm_id(request))
        return JSONResponse({"state": sb.state})

    async def resume(self, request: Request) -> Response:
        sb = await self.manager.resume(self._vm_id(request))
        return JSONResponse({"state": sb.state})

    async def suspend(self, request: Request) -> Response:
        sb = await self.manager.suspend(self._vm_id(request))
        return JSONResponse({"state": sb.state})

    async def delete(self, request: Request) -> Response:
        await self.manager.delete(self._vm_id(request))
        return Response(status_code=204)

    async def delete_volume(self, request: Request) -> Response:
        await self.manager.delete_volume(str(request.path_params["volume_id"]))
        return Response(status_code=204)

    # --- templates ---

    async def start_build(self, request: Request) -> Response:
        body = await read_body(BuildBody, request)
        try:
            context = base64.b64decode(body.context, validate=True)
        except binascii.Error:
            raise Problem(400, "context must be base64 (of a tar archive)") from None
        try:
            build = self.builds.start(
                str(request.path_params["name"]), body.spec, context, body.environ
            )
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
        await self.manager.remove_template(str(request.path_params["name"]))
        return Response(status_code=204)

    async def reconcile(self, request: Request) -> Response:
        body = await read_body(ReconcileBody, request)
        return JSONResponse({"removed": await self.manager.reconcile(body.keep)})

    # --- exec ---

    async def exec(self, request: Request) -> Response:
        body = await read_body(ExecBody, request)
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
            body = parse(ExecBody, first["text"])
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


def make_app(manager: VMManager, secret: str) -> Starlette:
    api = WorkerAPI(manager)
    vm = "/vms/{vm_id}"
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/reconcile", api.reconcile, methods=["POST"]),
        Route(vm, api.create, methods=["PUT"]),
        Route(vm, api.delete, methods=["DELETE"]),
        Route(f"{vm}/claim", api.claim, methods=["POST"]),
        Route(f"{vm}/network", api.set_network, methods=["PUT"]),
        Route(f"{vm}/audit", api.audit, methods=["GET"]),
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
        Route(f"{vm}/files", api.download, methods=["GET"]),
        Route(f"{vm}/files", api.upload, methods=["PUT"]),
        Route(f"{vm}/files", api.remove, methods=["DELETE"]),
        Route(f"{vm}/files/list", api.list_dir, methods=["GET"]),
        Route(f"{vm}/files/stat", api.stat, methods=["GET"]),
        Route(f"{vm}/files/mkdir", api.mkdir, methods=["POST"]),
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
        middleware=[Middleware(BearerAuth, secret=secret)],
        exception_handlers={**handlers, HTTPException: _on_http, Exception: _on_unexpected},
    )


async def serve(manager: VMManager, secret: str, host: str, port: int) -> None:
    """Serve the worker API until cancelled (or a SIGINT/SIGTERM), then shut down cleanly."""
    config = uvicorn.Config(
        make_app(manager, secret), host=host, port=port, log_level="warning",
        lifespan="off", timeout_graceful_shutdown=5,
        ws="wsproto",  # the default implementation logs an error for every refused WebSocket
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        server.should_exit = True
        await task
        raise

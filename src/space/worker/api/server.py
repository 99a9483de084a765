"""The worker's HTTP API server (docs/worker-api.md): VM lifecycle for the controller here; exec
(`exec`), files (`files`), template builds (`templates`) and checkpoints (`checkpoints`) in
rooms of their own; all behind the deployment's worker secret.

Bodies are checked against the wire models (`space.worker.api.models`) and refused with a
problem+json 400 that names what was wrong (`errors` says what each failure means); the VM work
itself is `VMManager`'s. Lifecycle calls must carry the leader's epoch, which the worker's
`Fence` checks (412 when stale).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from space.gateway.client import GatewayError, Traffic
from space.gateway.policy import Policy
from space.http_server import KEEP_ALIVE_S, Server
from space.identity import TLSFiles
from space.logs import RequestLog
from space.problem import problem
from space.release import HEADER as RELEASE_HEADER
from space.release import VERSION, refusal
from space.tracing import Traced
from space.worker import ksm
from space.worker.agent_client import (
    AgentClient,
    AgentError,
)
from space.worker.api import checkpoints, console, files, processes, templates
from space.worker.api import exec as exec_
from space.worker.api.activity import Activity, ActivityMiddleware
from space.worker.api.bodies import Problem, read_body
from space.worker.api.errors import as_problem
from space.worker.api.models import (
    EPOCH_HEADER,
    AdoptVM,
    AdoptVolume,
    ClaimVM,
    CreateVM,
    Health,
    PushVolume,
    Reconcile,
    Reconciled,
    Resources,
    Shares,
    UsageReport,
    VMCreated,
    VMReport,
    VMStats,
    VMStatusAnswer,
    VMUsage,
    VolumePushed,
)
from space.worker.artifacts import templates as template_artifacts
from space.worker.artifacts import volumes as volume_artifacts
from space.worker.fence import Fence, StaleEpoch
from space.worker.network import NetworkError
from space.worker.sandboxes import (
    VMManager,
    VMManagerError,
    VolumeMount,
    usage,
)
from space.worker.sandboxes.capacity import meminfo_mib
from space.worker.sandboxes.records import EPOCH_FILE
from space.worker.templates.errors import (
    AuthenticationFailed,
    DigestMismatch,
    ImageError,
    ImageNotFound,
    RegistryError,
)
from space.worker.vmm.base import VMMError

log = logging.getLogger(__name__)

VM_PATH = re.compile(r"^/vms/([A-Za-z0-9_-]{1,64})(?:/|$)")
QUIET = re.compile(r"/health")  # the controller's probes, every second


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
        await _refuse(
            scope, receive, send,
            problem(401, "a valid worker secret is required (Authorization: Bearer …)",
                    headers={"WWW-Authenticate": "Bearer"}),
        )  # fmt: skip


async def _refuse(scope: Scope, receive: Receive, send: Send, answer: JSONResponse) -> None:
    """Send `answer`, or close a WebSocket whose server cannot answer its handshake with an
    HTTP response (code 4000 + the answer's status)."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get(
        "extensions", {}
    ):
        await send({"type": "websocket.close", "code": 4000 + answer.status_code})
        return
    await answer(scope, receive, send)


RELEASE_HEADER_KEY = RELEASE_HEADER.lower().encode()


class ReleaseCheck:
    """Every call's sender must be of a release this one works with (`space.release`), or is
    refused (426) naming both; each answer says which release this is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        theirs = next((bytes(v).decode(errors="replace") for k, v in scope["headers"]
                       if k == RELEASE_HEADER_KEY), None)  # fmt: skip
        # /health answers anyone: it says this release, so the caller can judge for itself.
        if scope["path"] != "/health" and (reason := refusal(theirs, "control plane")):
            await _refuse(scope, receive, send,
                          problem(426, reason, code="incompatible_release"))  # fmt: skip
            return

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (RELEASE_HEADER_KEY, VERSION.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, stamped)


# A pull that another try would fail alike (the sandbox gets the reason); any other registry
# error is the registry away for now (503: tried again).
PERMANENT = (ImageError, ImageNotFound, DigestMismatch, AuthenticationFailed)


@contextlib.contextmanager
def _pulling(what: str) -> Iterator[None]:
    """A failed pull of `what` as the worker's answer: 502 if another try would fail alike,
    503 (tried again) if the registry is away for now."""
    try:
        yield
    except PERMANENT as e:
        raise Problem(502, f"{what} could not be pulled: {e}") from None
    except (RegistryError, OSError) as e:
        raise Problem(503, f"{what} not pulled yet: {e}") from None


# --- routes -----------------------------------------------------------------------------------


class WorkerAPI:
    def __init__(
        self, manager: VMManager, fence: Fence, problems: Callable[[], list[str]], instance: str
    ) -> None:
        self.manager = manager
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

    def _shares(self) -> Shares:
        """The limits in force here: the driver's on disks, the network manager's on taps."""
        disk = self.manager.driver.shares
        egress = self.manager.egress
        return Shares(disk_mib_s=disk.disk_mib_s if disk else 0,
                      disk_iops=disk.disk_iops if disk else 0,
                      net_mbit=egress.manager.config.rate_mbit if egress else 0)  # fmt: skip

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
            worker_id=m.worker_id, instance=self.instance, version=VERSION,
            epoch=self.fence.epoch,
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
            templates={name: r.digest for name, r in m.records.items()},
            registry=m.artifacts is not None,
            shares=self._shares(),
        )  # fmt: skip
        return JSONResponse(health.model_dump(mode="json"))

    async def create(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(CreateVM, request)
        if self.problems() and self.manager.egress is not None:
            raise Problem(503, f"this worker cannot start VMs now: {'; '.join(self.problems())}")
        if body.template_build is not None:
            with _pulling(f"template {body.template}"):
                await template_artifacts.ensure(self.manager, body.template, body.template_build)
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

    async def usage(self, request: Request) -> Response:
        traffic: dict[str, Traffic] | None = {}
        if self.manager.egress is not None:
            try:
                traffic = await self.manager.egress.gateway.traffic()
            except GatewayError as e:
                log.warning("no traffic counts from the gateway: %s", e)
                traffic = None
        suspended = self.manager.layout.suspended
        metered = await asyncio.gather(
            *(usage.meter(sb, self.manager.network_of(sb.id), suspended)
              for sb in self.manager.vms())
        )  # fmt: skip
        vms = [_vm_usage(m, traffic) for m in metered if m is not None]
        return JSONResponse(UsageReport(at=time.time(), vms=vms).model_dump(mode="json"))

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
        answer = VMStatusAnswer(id=sb.id, state=sb.state, artifact=sb.artifact)  # type: ignore[arg-type]
        return JSONResponse(answer.model_dump())

    async def adopt(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(AdoptVM, request)
        with _pulling("the sandbox"):
            sb = await self.manager.adopt(self._vm_id(request), body.artifact)
        return _state(sb.id, sb.state)

    async def delete(self, request: Request) -> Response:
        self._fenced(request)
        await self.manager.delete(self._vm_id(request))
        return Response(status_code=204)

    async def push_volume(self, request: Request) -> Response:
        self._fenced(request)
        volume_id = str(request.path_params["volume_id"])
        body = await read_body(PushVolume, request)
        try:
            artifact = await volume_artifacts.push(self.manager, volume_id, body.generation)
        except (RegistryError, OSError) as e:
            raise Problem(503, f"volume {volume_id} not pushed: {e}") from None
        return JSONResponse(VolumePushed(id=volume_id, artifact=artifact).model_dump())

    async def adopt_volume(self, request: Request) -> Response:
        self._fenced(request)
        volume_id = str(request.path_params["volume_id"])
        body = await read_body(AdoptVolume, request)
        with _pulling(f"volume {volume_id}"):
            await volume_artifacts.adopt(self.manager, volume_id, body.artifact, body.size_mib)
        return Response(status_code=204)

    async def delete_volume(self, request: Request) -> Response:
        self._fenced(request)
        await self.manager.delete_volume(str(request.path_params["volume_id"]))
        return Response(status_code=204)

    async def reconcile(self, request: Request) -> Response:
        self._fenced(request)
        body = await read_body(Reconcile, request)
        removed = Reconciled(removed=await self.manager.reconcile(body.keep))
        return JSONResponse(removed.model_dump())


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


def _vm_usage(m: usage.Metered, traffic: dict[str, Traffic] | None) -> VMUsage:
    counted = None if traffic is None else traffic.get(m.id, Traffic("", {}))
    vm = VMUsage(
        id=m.id, state=m.state, stored_bytes=m.stored_bytes,  # type: ignore[arg-type]
        traffic=None if counted is None else counted.hosts,
        traffic_epoch=None if counted is None else counted.epoch,
    )  # fmt: skip
    if m.used is None:
        return vm
    u = m.used
    return vm.model_copy(
        update={"vmm": u.vmm, "vmm_age_s": u.vmm_age_s, "cpu_seconds": u.cpu_seconds,
                "disk_bytes": u.disk_bytes,
                "net_rx_bytes": u.net_rx_bytes, "net_tx_bytes": u.net_tx_bytes}
    )  # fmt: skip


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
        Route("/usage", api.usage, methods=["GET"]),
        Route(vm, api.create, methods=["PUT"]),
        Route(vm, api.delete, methods=["DELETE"]),
        Route(f"{vm}/claim", api.claim, methods=["POST"]),
        Route(f"{vm}/network", api.set_network, methods=["PUT"]),
        Route(f"{vm}/audit", api.audit, methods=["GET"]),
        Route(f"{vm}/stats", api.stats, methods=["GET"]),
        Route("/volumes/{volume_id}", api.delete_volume, methods=["DELETE"]),
        Route("/volumes/{volume_id}/push", api.push_volume, methods=["POST"]),
        Route("/volumes/{volume_id}/adopt", api.adopt_volume, methods=["POST"]),
        Route(f"{vm}/pause", api.pause, methods=["POST"]),
        Route(f"{vm}/resume", api.resume, methods=["POST"]),
        Route(f"{vm}/suspend", api.suspend, methods=["POST"]),
        Route(f"{vm}/adopt", api.adopt, methods=["POST"]),
        *exec_.routes(api),
        *files.routes(api),
        *console.routes(api),
        *processes.routes(api),
        *templates.routes(api),
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
            Middleware(ReleaseCheck),
            # Inside the authentication: only our own services' headers are believed.
            Middleware(RequestLog, sandbox_path=VM_PATH, trusted=True, quiet=QUIET),
            # In the caller's trace, which its headers carry.
            Middleware(Traced, quiet=QUIET, trusted=True),
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
        lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=KEEP_ALIVE_S,
        ws="wsproto",  # the default implementation logs an error for every refused WebSocket
    )  # fmt: skip
    server = Server(config)
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

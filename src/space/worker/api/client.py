"""The typed client of the worker API, used by the controller (lifecycle) and the API server
(data plane). Every call goes through a method here, with its own deadline; nobody else builds
worker URLs or bodies.

`Worker` is one worker as a caller sees it (its URL); `WorkerClient` holds the connection pools,
the credentials (a bearer secret, and a TLS context when the cluster runs mutual TLS) and the
fencing epoch lifecycle calls carry.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import httpx
from httpx_ws import AsyncWebSocketSession, aconnect_ws
from pydantic import BaseModel, TypeAdapter, ValidationError

from space import logs, tracing
from space.gateway.policy import Policy
from space.identity import worker_name
from space.release import HEADER as RELEASE_HEADER
from space.release import VERSION
from space.worker.api.models import (
    EPOCH_HEADER,
    AdoptVM,
    AdoptVolume,
    AuditItems,
    BuildRequest,
    BuildStatus,
    CheckpointTaken,
    ClaimVM,
    CreateVM,
    ExecEvent,
    ExecRequest,
    FileEntry,
    FileList,
    Forked,
    ForkVM,
    Health,
    ProcessInfo,
    ProcessList,
    ProcessSignal,
    PushVolume,
    Reconcile,
    Reconciled,
    TerminalSize,
    UsageReport,
    VMCreated,
    VMStats,
    VMStatusAnswer,
    VolumePushed,
    WriteResult,
)

A = TypeVar("A", bound=BaseModel)
R = TypeVar("R")
EVENTS: TypeAdapter[ExecEvent] = TypeAdapter(ExecEvent)

# Deadlines (seconds) per kind of call. A create may cold-boot a VM and build its shape's base
# snapshot, then wait for a template's service to be ready.
CONNECT_S = 3.0
PROBE_S = 2.0
CLAIM_S = 3.0
STATS_S = 5.0
QUICK_S = 15.0
STATE_S = 120.0
CREATE_S = 330.0
# How long the API waits for a worker that refuses connections: one restarting (a rollout
# replaces each worker in turn) is back within this.
RESTART_S = 15.0
MAX_ANSWER = 16 << 20  # a worker's JSON answer larger than this is refused unread
WS_MESSAGE = 1 << 20


class WorkerError(Exception):
    """A worker refused or failed a call; `status` is its HTTP status (0: unreachable or no
    answer in time; `timed_out` says which), `code` its problem code if it sent one."""

    def __init__(
        self,
        status: int,
        detail: str,
        code: str | None = None,
        timed_out: bool = False,
        holders: list[str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code
        self.timed_out = timed_out
        self.holders = holders or []  # with code volume_in_use: the VMs holding it there


@dataclass(frozen=True)
class Worker:
    """A worker by its id and URL (from its registration)."""

    id: str
    url: str

    def vm(self, vm_id: str, *rest: str) -> str:
        return "/".join([self.url.rstrip("/"), "vms", vm_id, *rest])

    def path(self, *parts: str) -> str:
        return "/".join([self.url.rstrip("/"), *parts])


def _problem(status: int, raw: bytes) -> WorkerError:
    code, holders = None, []
    try:
        body = json.loads(raw)
        detail = str(body.get("detail") or body.get("title") or body)
        code = body.get("code")
        holders = [h for h in body.get("holders") or [] if isinstance(h, str)][:64]
    except (ValueError, AttributeError, TypeError):
        detail = raw[:500].decode(errors="replace")
    return WorkerError(status, detail, code if isinstance(code, str) else None, holders=holders)


def _refused(e: BaseException) -> bool:
    """Whether the connection was refused (nothing listens on the port), as its cause says."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _transport_error(url: str, e: httpx.TransportError) -> WorkerError:
    timed_out = isinstance(e, httpx.TimeoutException)
    what = "did not answer in time" if timed_out else "unreachable"
    return WorkerError(0, f"worker at {url} {what}: {e or type(e).__name__}", timed_out=timed_out)


class WorkerClient:
    """One client for every worker. `epoch` gives the fencing epoch for lifecycle calls (the
    controller's lease); a caller without one (the API) makes data-plane calls, and passes the
    epoch it read to the few lifecycle calls it makes."""

    def __init__(
        self,
        secret: str,
        *,
        epoch: Callable[[], int] | None = None,
        tls: ssl.SSLContext | None = None,
        reconnect_s: float = 0.0,
    ) -> None:
        self._epoch = epoch
        self._tls = tls is not None
        # How long a call waits for a worker that refuses connections (a restart, a rollout)
        # before it fails: the API's callers see a wait, not an error; the controller's probes
        # must see the refusal at once.
        self._reconnect_s = reconnect_s
        self._new_pool = partial(
            httpx.AsyncClient,
            timeout=httpx.Timeout(QUICK_S, connect=CONNECT_S),
            headers={"Authorization": f"Bearer {secret}", RELEASE_HEADER: VERSION},
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
            verify=tls if tls is not None else True,
            event_hooks={"request": [_carry_context]},
        )
        self._pools: dict[str, httpx.AsyncClient] = {}

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.aclose()

    # --- plumbing -----------------------------------------------------------------------------

    def _route(self, w: Worker) -> tuple[httpx.AsyncClient, dict[str, Any]]:
        """The connection pool for `w` and the request's extensions. Under mutual TLS the
        worker's certificate must name the id it registered with, so a host showing another
        worker's is refused, and each id has a pool of its own: a connection verified as one
        worker is never reused for another at the same address. A worker not served over TLS
        is refused at once."""
        if not self._tls:
            return self._pool(""), {}
        if not w.url.startswith("https://"):
            raise WorkerError(0, f"worker {w.id} at {w.url} is not served over TLS")
        return self._pool(w.id), {"sni_hostname": worker_name(w.id)}

    def _pool(self, key: str) -> httpx.AsyncClient:
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = self._new_pool()
        return pool

    async def _connected(
        self, url: str, attempt: Callable[[], Awaitable[R]], within: float | None = None
    ) -> R:
        """`attempt()`, tried again while the worker refuses to connect, for up to
        `reconnect_s` and within the call's own deadline: a refused connection carried
        nothing, so nothing is done twice."""
        wait = self._reconnect_s if within is None else min(self._reconnect_s, within)
        deadline = time.monotonic() + wait
        pause = 0.1
        while True:
            try:
                return await attempt()
            except httpx.ConnectError as e:
                # Only a refusal is a restart: a name that does not resolve, a host that is not
                # there or a certificate that does not match will not mend in seconds.
                if not _refused(e) or time.monotonic() + pause > deadline:
                    raise _transport_error(url, e) from e
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    def _headers(self, epoch: int | None) -> dict[str, str]:
        if epoch is None and self._epoch is not None:
            epoch = self._epoch()
        return {EPOCH_HEADER: str(epoch)} if epoch is not None else {}

    async def _call(
        self,
        method: str,
        w: Worker,
        url: str,
        answer: type[A] | None,
        *,
        timeout: float,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
        fenced: bool = False,
        epoch: int | None = None,
        raw: bytes | None = None,
        wait_restart: bool = True,
    ) -> A | None:
        """One call and its JSON answer; the body is `body` as JSON, or the bytes `raw`."""
        content = body.model_dump_json(exclude_none=False).encode() if body is not None else raw
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if fenced:
            headers.update(self._headers(epoch))
        http, extensions = self._route(w)

        async def attempt() -> tuple[httpx.Response, bytes]:
            async with http.stream(
                method, url, content=content, params=params, headers=headers,
                timeout=httpx.Timeout(timeout, connect=min(CONNECT_S, timeout)),
                extensions=extensions,
            ) as resp:  # fmt: skip
                return resp, await _read_capped(resp)

        try:
            resp, got = await self._connected(url, attempt, within=timeout if wait_restart else 0)
        except httpx.TransportError as e:
            raise _transport_error(url, e) from e
        if not resp.is_success:
            raise _problem(resp.status_code, got)
        if answer is None:
            return None
        try:
            return answer.model_validate_json(got)
        except ValidationError as e:
            raise WorkerError(502, f"worker at {url} answered nonsense: {e}") from None

    @asynccontextmanager
    async def _stream(
        self,
        method: str,
        w: Worker,
        url: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        content: AsyncIterable[bytes] | None = None,
        read_timeout: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """A streamed call; a non-2xx answer raises before the body is handed over. A stream
        may rightly stay silent for as long as its process runs, so reading is unbounded unless
        `read_timeout` says otherwise; connecting and the answer's head are bounded."""
        timeout = httpx.Timeout(QUICK_S, connect=CONNECT_S, read=read_timeout, write=QUICK_S)
        http, extensions = self._route(w)
        req = http.build_request(
            method, url, json=json_body, params=params, content=content, timeout=timeout,
            extensions=extensions,
        )  # fmt: skip
        try:
            resp = await self._connected(url, lambda: http.send(req, stream=True))
        except httpx.TransportError as e:
            raise _transport_error(url, e) from e
        try:
            if not resp.is_success:
                raise _problem(resp.status_code, await _read_capped(resp))
            yield resp
        finally:
            await resp.aclose()

    # --- lifecycle (fenced) -------------------------------------------------------------------

    async def health(self, w: Worker, timeout: float = PROBE_S) -> Health:
        """The worker's state; the epoch the caller holds goes along, so a new leader's first
        probe already tells every worker to refuse the old one."""
        got = await self._call(
            "GET", w, w.path("health"), Health, timeout=timeout, fenced=self._epoch is not None,
            wait_restart=False,  # a probe: its answer is whether the worker answers now
        )  # fmt: skip
        assert got is not None
        return got

    async def create_vm(self, w: Worker, vm_id: str, body: CreateVM) -> VMCreated:
        got = await self._call(
            "PUT", w, w.vm(vm_id), VMCreated, timeout=CREATE_S, body=body, fenced=True
        )
        assert got is not None
        return got

    async def claim_vm(self, w: Worker, vm_id: str, body: ClaimVM, epoch: int) -> VMStatusAnswer:
        got = await self._call(
            "POST", w, w.vm(vm_id, "claim"), VMStatusAnswer, timeout=CLAIM_S, body=body,
            fenced=True, epoch=epoch, wait_restart=False,  # a miss has a fallback: a restore
        )  # fmt: skip
        assert got is not None
        return got

    async def change_vm(self, w: Worker, vm_id: str, verb: str) -> VMStatusAnswer:
        """pause, resume (from paused, or a restore from suspended) or suspend."""
        if verb not in ("pause", "resume", "suspend"):
            raise ValueError(f"no VM change {verb!r}")
        got = await self._call(
            "POST", w, w.vm(vm_id, verb), VMStatusAnswer, timeout=STATE_S, fenced=True
        )
        assert got is not None
        return got

    async def adopt_vm(self, w: Worker, vm_id: str, body: AdoptVM) -> VMStatusAnswer:
        """Pull a sandbox suspended elsewhere onto `w` (it stays suspended)."""
        got = await self._call(
            "POST", w, w.vm(vm_id, "adopt"), VMStatusAnswer, timeout=CREATE_S, body=body,
            fenced=True,
        )  # fmt: skip
        assert got is not None
        return got

    async def checkpoint_vm(
        self, w: Worker, vm_id: str, checkpoint_id: str, epoch: int
    ) -> CheckpointTaken:
        got = await self._call(
            "POST", w, w.vm(vm_id, "checkpoints", checkpoint_id), CheckpointTaken, timeout=STATE_S,
            fenced=True, epoch=epoch,
        )  # fmt: skip
        assert got is not None
        return got

    async def delete_checkpoint(
        self, w: Worker, vm_id: str, checkpoint_id: str, epoch: int | None = None
    ) -> None:
        await self._call(
            "DELETE", w, w.vm(vm_id, "checkpoints", checkpoint_id), None, timeout=QUICK_S,
            fenced=True, epoch=epoch,
        )  # fmt: skip

    async def rollback_vm(
        self, w: Worker, vm_id: str, checkpoint_id: str, epoch: int
    ) -> VMStatusAnswer:
        got = await self._call(
            "POST", w, w.vm(vm_id, "checkpoints", checkpoint_id, "rollback"), VMStatusAnswer,
            timeout=STATE_S, fenced=True, epoch=epoch,
        )  # fmt: skip
        assert got is not None
        return got

    async def fork_vm(self, w: Worker, vm_id: str, body: ForkVM, epoch: int) -> Forked:
        got = await self._call(
            "POST", w, w.vm(vm_id, "fork"), Forked, timeout=CREATE_S, body=body, fenced=True,
            epoch=epoch,
        )  # fmt: skip
        assert got is not None
        return got

    async def delete_vm(self, w: Worker, vm_id: str, epoch: int | None = None) -> None:
        await self._call("DELETE", w, w.vm(vm_id), None, timeout=STATE_S, fenced=True, epoch=epoch)

    async def set_network(self, w: Worker, vm_id: str, policy: Policy) -> None:
        await self._call(
            "PUT", w, w.vm(vm_id, "network"), None, timeout=QUICK_S, body=policy, fenced=True
        )

    async def reconcile(self, w: Worker, keep: list[str]) -> Reconciled:
        got = await self._call(
            "POST", w, w.path("reconcile"), Reconciled, timeout=STATE_S, body=Reconcile(keep=keep),
            fenced=True,
        )  # fmt: skip
        assert got is not None
        return got

    async def push_volume(self, w: Worker, volume_id: str, generation: int) -> VolumePushed:
        got = await self._call(
            "POST", w, w.path("volumes", volume_id, "push"), VolumePushed, timeout=STATE_S,
            body=PushVolume(generation=generation), fenced=True,
        )  # fmt: skip
        assert got is not None
        return got

    async def adopt_volume(self, w: Worker, volume_id: str, body: AdoptVolume) -> None:
        await self._call(
            "POST", w, w.path("volumes", volume_id, "adopt"), None, timeout=CREATE_S, body=body,
            fenced=True,
        )  # fmt: skip

    async def delete_volume(self, w: Worker, volume_id: str) -> None:
        await self._call(
            "DELETE", w, w.path("volumes", volume_id), None, timeout=QUICK_S, fenced=True
        )

    async def delete_template(self, w: Worker, name: str) -> None:
        await self._call("DELETE", w, w.path("templates", name), None, timeout=STATE_S, fenced=True)

    async def start_build(self, w: Worker, name: str, body: BuildRequest) -> BuildStatus:
        got = await self._call(
            "POST", w, w.path("templates", name, "builds"), BuildStatus, timeout=STATE_S,
            body=body, fenced=True,
        )  # fmt: skip
        assert got is not None
        return got

    async def build_status(self, w: Worker, build_id: str) -> BuildStatus:
        got = await self._call("GET", w, w.path("builds", build_id), BuildStatus, timeout=QUICK_S)
        assert got is not None
        return got

    def build_log(self, w: Worker, build_id: str) -> AbstractAsyncContextManager[httpx.Response]:
        return self._stream("GET", w, w.path("builds", build_id, "log"))

    # --- data plane ---------------------------------------------------------------------------

    async def audit(self, w: Worker, vm_id: str, after: int = 0) -> AuditItems:
        got = await self._call(
            "GET", w, w.vm(vm_id, "audit"), AuditItems, timeout=QUICK_S, params={"after": after}
        )
        assert got is not None
        return got

    async def usage(self, w: Worker) -> UsageReport:
        got = await self._call("GET", w, w.path("usage"), UsageReport, timeout=STATS_S)
        assert got is not None
        return got

    async def stats(self, w: Worker, vm_id: str) -> VMStats:
        got = await self._call("GET", w, w.vm(vm_id, "stats"), VMStats, timeout=STATS_S)
        assert got is not None
        return got

    def exec_stream(
        self, w: Worker, vm_id: str, body: ExecRequest
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """The raw NDJSON event stream of a process (relayed as it is by the API)."""
        return self._stream("POST", w, w.vm(vm_id, "exec"), json_body=body.wire())

    @asynccontextmanager
    async def exec_events(
        self, w: Worker, vm_id: str, body: ExecRequest
    ) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """The events of a process, parsed (at most 1 MiB per line)."""
        async with self.exec_stream(w, vm_id, body) as resp:
            yield _events(resp)

    def exec_ws(self, w: Worker, vm_id: str) -> AbstractAsyncContextManager[AsyncWebSocketSession]:
        return self._ws(w, w.vm(vm_id, "exec", "ws"))

    # --- processes (a pid or a tag as `ref`) ---

    async def start_process(self, w: Worker, vm_id: str, body: ExecRequest) -> ProcessInfo:
        got = await self._call("POST", w, w.vm(vm_id, "processes"), ProcessInfo,
                               timeout=QUICK_S, body=body)  # fmt: skip
        assert got is not None
        return got

    async def processes(self, w: Worker, vm_id: str) -> ProcessList:
        got = await self._call("GET", w, w.vm(vm_id, "processes"), ProcessList, timeout=QUICK_S)
        assert got is not None
        return got

    async def process(self, w: Worker, vm_id: str, ref: str) -> ProcessInfo:
        got = await self._call(
            "GET", w, w.vm(vm_id, "processes", ref), ProcessInfo, timeout=QUICK_S
        )
        assert got is not None
        return got

    def console(
        self, w: Worker, vm_id: str, tail: int, follow: bool
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """The VM's serial console: its last `tail` bytes, then what comes if `follow`."""
        params = {"tail": tail, "follow": str(follow).lower()}
        return self._stream("GET", w, w.vm(vm_id, "console"), params=params)

    def process_output(
        self, w: Worker, vm_id: str, ref: str, replay: bool
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """The NDJSON events of a process followed (as `exec_stream`'s)."""
        params = {"replay": str(replay).lower()}
        return self._stream("GET", w, w.vm(vm_id, "processes", ref, "output"), params=params)

    @asynccontextmanager
    async def process_events(
        self, w: Worker, vm_id: str, ref: str, replay: bool
    ) -> AsyncIterator[AsyncIterator[ExecEvent]]:
        """The events of a process followed, parsed (as `exec_events`')."""
        async with self.process_output(w, vm_id, ref, replay) as resp:
            yield _events(resp)

    def process_ws(
        self, w: Worker, vm_id: str, ref: str, replay: bool
    ) -> AbstractAsyncContextManager[AsyncWebSocketSession]:
        url = w.vm(vm_id, "processes", ref, "ws") + ("" if replay else "?replay=false")
        return self._ws(w, url)

    async def process_stdin(
        self, w: Worker, vm_id: str, ref: str, data: bytes, eof: bool = False
    ) -> None:
        await self._call("POST", w, w.vm(vm_id, "processes", ref, "stdin"), None,
                         timeout=QUICK_S, raw=data, params={"eof": str(eof).lower()})  # fmt: skip

    async def signal_process(self, w: Worker, vm_id: str, ref: str, signal: int) -> None:
        await self._call("POST", w, w.vm(vm_id, "processes", ref, "signal"), None,
                         timeout=QUICK_S, body=ProcessSignal(signal=signal))  # fmt: skip

    async def resize_process(self, w: Worker, vm_id: str, ref: str, size: TerminalSize) -> None:
        await self._call("POST", w, w.vm(vm_id, "processes", ref, "resize"), None,
                         timeout=QUICK_S, body=size)  # fmt: skip

    async def kill_process(self, w: Worker, vm_id: str, ref: str) -> None:
        await self._call("DELETE", w, w.vm(vm_id, "processes", ref), None, timeout=QUICK_S)

    def tcp(
        self, w: Worker, vm_id: str, port: int
    ) -> AbstractAsyncContextManager[AsyncWebSocketSession]:
        """A TCP connection to `port` inside the VM, as a WebSocket (`TCP_EOF` in models)."""
        return self._ws(w, w.vm(vm_id, "tcp", str(port)))

    def _ws(self, w: Worker, url: str) -> AbstractAsyncContextManager[AsyncWebSocketSession]:
        http, extensions = self._route(w)
        url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        return aconnect_ws(url, http, max_message_size_bytes=WS_MESSAGE,
                           extensions=extensions)  # fmt: skip

    def download(
        self, w: Worker, vm_id: str, path: str
    ) -> AbstractAsyncContextManager[httpx.Response]:
        return self._stream("GET", w, w.vm(vm_id, "files"), params={"path": path})

    def watch(
        self, w: Worker, vm_id: str, path: str, recursive: bool
    ) -> AbstractAsyncContextManager[httpx.Response]:
        """The NDJSON events of a file watch (relayed as they are by the API)."""
        params = {"path": path, "recursive": str(recursive).lower()}
        return self._stream("GET", w, w.vm(vm_id, "files", "watch"), params=params)

    async def upload(
        self,
        w: Worker,
        vm_id: str,
        path: str,
        content: AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        make_parents: bool = False,
    ) -> WriteResult:
        params = {"path": path, "mode": mode, "make_parents": str(make_parents).lower()}
        async with self._stream(
            "PUT", w, w.vm(vm_id, "files"), params=params, content=content, read_timeout=STATE_S
        ) as resp:
            raw = await _read_capped(resp)
        return WriteResult.model_validate_json(raw)

    async def list_dir(self, w: Worker, vm_id: str, path: str) -> FileList:
        got = await self._call(
            "GET", w, w.vm(vm_id, "files", "list"), FileList, timeout=QUICK_S,
            params={"path": path},
        )  # fmt: skip
        assert got is not None
        return got

    async def stat(self, w: Worker, vm_id: str, path: str) -> FileEntry:
        got = await self._call(
            "GET", w, w.vm(vm_id, "files", "stat"), FileEntry, timeout=QUICK_S,
            params={"path": path},
        )  # fmt: skip
        assert got is not None
        return got

    async def remove(self, w: Worker, vm_id: str, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": str(recursive).lower()}
        await self._call("DELETE", w, w.vm(vm_id, "files"), None, timeout=STATE_S, params=params)

    async def rename(
        self, w: Worker, vm_id: str, path: str, to: str, overwrite: bool = False
    ) -> FileEntry:
        got = await self._call(
            "POST", w, w.vm(vm_id, "files", "rename"), FileEntry, timeout=QUICK_S,
            params={"path": path, "to": to, "overwrite": str(overwrite).lower()},
        )  # fmt: skip
        assert got is not None
        return got

    async def mkdir(self, w: Worker, vm_id: str, path: str, parents: bool = False) -> FileEntry:
        got = await self._call(
            "POST", w, w.vm(vm_id, "files", "mkdir"), FileEntry, timeout=QUICK_S,
            params={"path": path, "parents": str(parents).lower()},
        )  # fmt: skip
        assert got is not None
        return got


async def _carry_context(request: httpx.Request) -> None:
    """Every call names the request it is made for (for the worker's logs) and its trace."""
    request.headers.update(logs.context_headers())
    request.headers.update(tracing.headers())


async def _read_capped(resp: httpx.Response, limit: int = MAX_ANSWER) -> bytes:
    out = bytearray()
    async for chunk in resp.aiter_raw():
        out += chunk
        if len(out) > limit:
            raise WorkerError(502, f"the worker's answer is over {limit >> 20} MiB")
    return bytes(out)


async def _events(resp: httpx.Response) -> AsyncIterator[ExecEvent]:
    async for line in resp.aiter_lines():
        if not line:
            continue
        if len(line) > WS_MESSAGE * 2:
            raise WorkerError(502, "an exec event from the worker is too large")
        try:
            yield EVENTS.validate_python(json.loads(line))
        except (ValueError, ValidationError) as e:
            raise WorkerError(502, f"the worker sent a broken exec event: {e}") from None

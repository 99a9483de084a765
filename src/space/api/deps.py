"""What every route needs: the database, the wake-up listener, workers, and the caller's tenant."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request, WebSocket

from space import logs, tracing
from space.api import audit_trail
from space.api.errors import APIError
from space.api.ingress_tunnels import Tunnels
from space.api.limits import RateLimiter
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Conflict, Row, Store, Tenant
from space.identity import WorkerCA
from space.netpolicy import NetworkPolicy
from space.settings import Settings
from space.webhooks.targets import egress_floor
from space.worker.api.client import Worker, WorkerClient

RECHECK_S = 2.0  # a waiter looks again this often even without a notification
# Streams a tenant may follow at once through one API process (a sandbox's console, its
# events): each holds a connection to a worker or the database's attention for as long as it
# lasts, so one tenant's many must not starve the others.
FOLLOWERS_PER_TENANT = 32
WAKE_S = 60.0  # how long a call waits for a sandbox the idle policy paused to run again


@dataclass
class Services:
    store: Store
    listener: Listener
    workers: WorkerClient
    sealer: Sealer
    settings: Settings
    metrics_token: str
    rates: RateLimiter
    worker_secret: str  # what workers present when they register
    worker_ca: WorkerCA | None = None  # issues workers' certificates under mutual TLS
    followers: dict[str, int] = field(default_factory=dict)  # tenant: streams it follows now
    tunnels: Tunnels = field(default_factory=Tunnels)  # ingress's kept connections

    def follow(self, tenant_id: str) -> Callable[[], None]:
        """A place for one more followed stream of the tenant (429 past its share); call what
        is returned once the stream ends."""
        held = self.followers.get(tenant_id, 0)
        if held >= FOLLOWERS_PER_TENANT:
            raise APIError(429, f"{held} streams of this tenant are followed already: end one "
                           "first", headers={"Retry-After": "5"})  # fmt: skip
        self.followers[tenant_id] = held + 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.followers[tenant_id] -= 1
                if not self.followers[tenant_id]:
                    del self.followers[tenant_id]

        return release

    async def wait_for(self, sandbox_id: str, done: Callable[[Row], bool], timeout: float) -> Row:
        """Until `done(row)`; the last row seen if the timeout passes first."""
        ev = self.listener.subscribe(sandbox_id)
        deadline = time.monotonic() + timeout
        try:
            while True:
                ev.clear()
                row = await self.store.get_sandbox(sandbox_id)
                left = deadline - time.monotonic()
                if done(row) or left <= 0:
                    return row
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), min(left, RECHECK_S))
        finally:
            self.listener.unsubscribe(ev, sandbox_id)

    def check_egress(self, network: NetworkPolicy) -> None:
        """422 naming every part of a policy that asks for what no sandbox may reach (the
        host, cloud metadata, other sandboxes, private networks the operator did not open);
        the gateway refuses those dials anyway."""
        floor = egress_floor(list(self.settings.egress_open_networks))
        if refused := floor.refusals(network.gateway()):
            raise APIError(422, "network policy refused: " + "; ".join(refused))

    async def wait_for_template(
        self, template_id: str, done: Callable[[Row], bool], timeout: float
    ) -> Row:
        """Until `done(template row)` (templates change rarely: looked at every 0.2 s)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = await self.store.templates(template_id)
            if not rows:
                raise APIError(404, f"no template {template_id!r}")
            if done(rows[0]) or time.monotonic() > deadline:
                return rows[0]
            await asyncio.sleep(0.2)

    async def in_use(self, row: Row) -> Row:
        """The sandbox for a call that uses it: one the idle policy paused is resumed first
        (paused by its owner, it stays paused and the call is refused)."""
        if not row["idle_paused"] or row["desired_state"] != "paused":
            return row
        if row["state"] == "pausing":
            row = await self.wait_for(row["id"], lambda r: r["state"] != "pausing", WAKE_S)
        with contextlib.suppress(Conflict):  # resumed by another call meanwhile
            await self.store.request(
                row["tenant_id"], row["id"], "running", ("paused",), "resume",
                request_id=logs.request_id.get(), reason="used again after an idle pause",
                trace_parent=tracing.traceparent(),
            )  # fmt: skip
        return await self.wait_for(
            row["id"],
            lambda r: (
                r["state"] in ("running", "error", "deleted") or r["desired_state"] != "running"
            ),
            WAKE_S,
        )

    async def running_on(self, row: Row) -> Worker:
        """The worker of a running sandbox, for the data plane."""
        if row["state"] != "running":
            raise APIError(409, f"sandbox {row['id']} is {row['state']}, not running",
                           state=row["state"])  # fmt: skip
        return await self.worker_of(row)

    async def worker_of(self, row: Row) -> Worker:
        worker = await self.store.worker(row["worker_id"]) if row["worker_id"] else None
        if worker is None:
            raise APIError(503, f"sandbox {row['id']} has no worker")
        if worker["state"] != "active":
            raise APIError(503, f"worker {worker['id']} of sandbox {row['id']} is not available",
                           headers={"Retry-After": "5"})  # fmt: skip
        logs.bind(worker=worker["id"])
        return Worker(worker["id"], worker["url"])


def _woken(row: Row) -> bool:
    return row["state"] in ("running", "error", "deleted") or row["desired_state"] != "running"


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def bearer(header: str | None) -> str:
    if not header or not header.startswith("Bearer "):
        return ""
    return header[len("Bearer ") :].strip()


async def authenticate(svc: Services, key: str) -> Tenant:
    if not key:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
    tenant = await svc.store.authenticate(key)
    if tenant is None:
        raise APIError(401, "invalid or revoked API key")
    return admit(svc, tenant)


def admit(svc: Services, tenant: Tenant) -> Tenant:
    """The tenant, unless it is past its rate (429)."""
    logs.bind(tenant=tenant.id)
    audit_trail.note_caller(tenant)
    if wait := svc.rates.take(tenant.id):
        raise APIError(
            429,
            f"too many requests: at most {svc.rates.rate:g} a second "
            f"(bursts of {svc.rates.burst}) per tenant",
            headers={"Retry-After": str(math.ceil(wait))},
        )
    return tenant


def require_admin(caller: Tenant, what: str) -> None:
    """403 unless the caller's key is an admin key, an operator's (`what` it was denied)."""
    if not caller.admin:
        raise APIError(403, f"only an admin key may {what}")


async def tenant(request: Request) -> Tenant:
    return await authenticate(services(request), bearer(request.headers.get("authorization")))


async def ws_tenant(websocket: WebSocket) -> Tenant:
    svc: Services = websocket.app.state.services
    key = bearer(websocket.headers.get("authorization")) or websocket.query_params.get("token", "")
    return await authenticate(svc, key)


Svc = Annotated[Services, Depends(services)]
Caller = Annotated[Tenant, Depends(tenant)]

"""What every route needs: the database, the wake-up listener, workers, and the caller's tenant."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request, WebSocket

from space.api.errors import APIError
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Row, Store, Tenant
from space.worker.client import WorkerClient

RECHECK_S = 2.0  # a waiter looks again this often even without a notification


@dataclass
class Services:
    store: Store
    listener: Listener
    workers: WorkerClient
    sealer: Sealer

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

    async def worker_url(self, row: Row) -> str:
        if row["state"] != "running":
            raise APIError(409, f"sandbox {row['id']} is {row['state']}, not running",
                           state=row["state"])  # fmt: skip
        worker = await self.store.worker(row["worker_id"]) if row["worker_id"] else None
        if worker is None:
            raise APIError(503, f"sandbox {row['id']} has no worker")
        return f"{worker['url']}/vms/{row['id']}"


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def _bearer(header: str | None) -> str:
    if not header or not header.startswith("Bearer "):
        return ""
    return header[len("Bearer ") :].strip()


async def authenticate(svc: Services, key: str) -> Tenant:
    if not key:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'")
    tenant = await svc.store.authenticate(key)
    if tenant is None:
        raise APIError(401, "invalid or revoked API key")
    return tenant


async def tenant(request: Request) -> Tenant:
    return await authenticate(services(request), _bearer(request.headers.get("authorization")))


async def ws_tenant(websocket: WebSocket) -> Tenant:
    svc: Services = websocket.app.state.services
    key = _bearer(websocket.headers.get("authorization")) or websocket.query_params.get("token", "")
    return await authenticate(svc, key)


Svc = Annotated[Services, Depends(services)]
Caller = Annotated[Tenant, Depends(tenant)]

"""The worker process (`space worker`): adopt this host's VMs, register, heartbeat, serve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets

from space.db import migrate
from space.db.store import Store, connect
from space.worker import netsetup
from space.worker.local import LocalRuntime, local_runtime
from space.worker.network import Egress
from space.worker.service import serve
from space.worker.vms import VMManager, meminfo_mib

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0


async def _heartbeat(store: Store, worker_id: str, instance: str) -> None:
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        try:
            if not await store.heartbeat(worker_id, instance, meminfo_mib("MemAvailable")):
                log.error("another process registered as worker %s; stopping", worker_id)
                return
        except Exception as e:  # the database may be restarting; keep trying
            log.warning("heartbeat failed: %s", e)


async def _listening(host: str, port: int, serving: asyncio.Future[None]) -> None:
    probe = "127.0.0.1" if host == "0.0.0.0" else host
    while not serving.done():
        try:
            _, writer = await asyncio.open_connection(probe, port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        return
    serving.result()  # it ended before it listened: say why


async def run(
    database_url: str, secret: str, *, worker_id: str, host: str, port: int, url: str
) -> None:
    runtime = await local_runtime()
    egress, gateway = None, None
    if netsetup.enabled():
        egress, gateway = await netsetup.start_egress(
            worker_id, runtime.pool.root / "workers" / worker_id
        )
    try:
        await _serve(runtime, egress, database_url, secret, worker_id, host, port, url)
    finally:
        if gateway is not None:
            await gateway.stop()


async def _serve(
    runtime: LocalRuntime,
    egress: Egress | None,
    database_url: str,
    secret: str,
    worker_id: str,
    host: str,
    port: int,
    url: str,
) -> None:
    # An operator may promise more (or less) than the host's defaults.
    manager = VMManager(
        runtime,
        worker_id,
        capacity_vcpus=int(os.environ.get("SPACE_WORKER_VCPUS", "0")) or None,
        capacity_memory_mib=int(os.environ.get("SPACE_WORKER_MEMORY_MIB", "0")) or None,
        base_snapshots=os.environ.get("SPACE_WORKER_BASE_SNAPSHOTS", "1") != "0",
        egress=egress,
    )
    await manager.start()  # re-adopt before announcing ourselves, so recovery finds the VMs
    store = Store(connect(database_url, pool_size=2))
    await migrate.upgrade(store.engine)
    instance = secrets.token_hex(8)
    serving = asyncio.ensure_future(serve(manager, secret, host, port))
    # Announced only once it answers: a caller picking it at once must reach it.
    await _listening(host, port, serving)
    await store.register_worker(
        worker_id, url, instance, manager.capacity_vcpus, manager.capacity_memory_mib
    )
    beating = asyncio.ensure_future(_heartbeat(store, worker_id, instance))
    try:
        await asyncio.wait([beating, serving], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (beating, serving):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await manager.close(stop_vms=False)  # VMs outlive the process; the next one adopts them
        await store.close()

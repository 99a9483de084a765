"""The controller process (`space controller`): wait for leadership, then run every loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable
from functools import partial

from prometheus_client import start_http_server

from space.config import sealing_keys
from space.controller import upkeep
from space.controller.leader import Leadership
from space.controller.pools import Pools
from space.controller.reconciler import Reconciler
from space.db import migrate
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Store, connect
from space.worker.client import WorkerClient

log = logging.getLogger(__name__)


def dead_after_s() -> float:
    return float(os.environ.get("SPACE_WORKER_DEAD_AFTER", "5"))


def serve_metrics() -> None:
    """Prometheus metrics at SPACE_CONTROLLER_METRICS (host:port), if it is set.

    A standby controller that finds the port taken runs on without them (the leader's are the
    ones that move)."""
    address = os.environ.get("SPACE_CONTROLLER_METRICS", "")
    if not address:
        return
    host, _, port = address.rpartition(":")
    try:
        start_http_server(int(port), host or "127.0.0.1")
    except (OSError, ValueError) as e:
        log.warning("no metrics at %s: %s", address, e)


async def run(database_url: str, worker_secret: str) -> None:
    serve_metrics()
    store = Store(connect(database_url))
    sealer = Sealer(sealing_keys(), reload=sealing_keys)
    await migrate.upgrade(store.engine)
    workers = WorkerClient(worker_secret)
    leadership = Leadership(database_url)
    try:
        while True:
            await leadership.acquire()
            listener = Listener(database_url)
            await listener.start()

            def health() -> Awaitable[None]:
                return upkeep.worker_health(store, workers, sealer, dead_after_s())

            pools = Pools(store)
            loops = [
                asyncio.ensure_future(Reconciler(store, workers, listener, pools, sealer).run()),
                asyncio.ensure_future(pools.run(listener)),
                asyncio.ensure_future(
                    upkeep.every(1.0, "timeouts", partial(upkeep.timeouts, store))
                ),
                asyncio.ensure_future(upkeep.every(1.0, "worker health", health)),
                asyncio.ensure_future(
                    upkeep.every(15.0, "gc", partial(upkeep.collect_garbage, store, workers))
                ),
                asyncio.ensure_future(
                    upkeep.every(1.0, "volumes", partial(upkeep.delete_volumes, store, workers))
                ),
                asyncio.ensure_future(
                    upkeep.every(0.5, "templates", partial(upkeep.template_builds, store, workers))
                ),
            ]
            lost = asyncio.ensure_future(leadership.lost())
            await asyncio.wait([lost, *loops], return_when=asyncio.FIRST_COMPLETED)
            log.warning("leadership lost; stopping every loop before trying again")
            for task in [lost, *loops]:
                task.cancel()
            for task in [lost, *loops]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await listener.close()
            await leadership.release()
    finally:
        await leadership.release()
        await workers.close()
        await store.close()

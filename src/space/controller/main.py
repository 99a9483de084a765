"""The controller process (`space controller`): wait for leadership, then run every loop until
it is lost, then stand by again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import partial

from space import crashpoints, tracing
from space.controller import metering, upkeep
from space.controller.health import WorkerHealth
from space.controller.leader import Leadership, LostLeadership
from space.controller.pools import Pools
from space.controller.reconciler import Reconciler
from space.db import migrate
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Store, connect
from space.identity import WorkerCA
from space.metrics_server import serve_metrics
from space.settings import Settings
from space.webhooks.dispatch import Webhooks
from space.webhooks.targets import egress_floor
from space.worker.api.client import WorkerClient

log = logging.getLogger(__name__)


async def run(settings: Settings, database_url: str) -> None:
    crashpoints.arm(settings.crash_at)
    tracing.start("controller", settings.otlp_endpoint)
    cs = settings.controller
    serve_metrics(cs.metrics_address, settings.load_metrics_token())
    store = Store(connect(database_url))
    sealer = Sealer(settings.load_sealing_keys(), reload=settings.load_sealing_keys)
    await migrate.upgrade(store.engine)
    leadership = Leadership(store, cs.lease_ttl_s)
    tls = WorkerCA(settings.worker_ca_dir).client_context() if settings.worker_ca_dir else None
    workers = WorkerClient(settings.load_worker_secret(), epoch=lambda: leadership.epoch, tls=tls)
    try:
        while True:
            await leadership.acquire()
            try:
                await _lead(settings, database_url, store, workers, sealer, leadership)
            except LostLeadership as e:
                log.warning("leadership lost: %s", e)
            except Exception:
                # Nothing a loop meets (the database away at the wrong moment) may end the
                # process: it stops leading, and competes for the lease again.
                log.exception("a controller loop failed")
                await asyncio.sleep(1)
            log.warning("stopped every loop; standing by")
            await leadership.release()
    finally:
        await leadership.release()
        await workers.close()
        await store.close()
        tracing.stop()


async def _lead(
    settings: Settings,
    database_url: str,
    store: Store,
    workers: WorkerClient,
    sealer: Sealer,
    leadership: Leadership,
) -> None:
    cs = settings.controller
    listener = Listener(database_url)
    await listener.start()
    health = WorkerHealth(store, workers, sealer, cs.worker_lost_after_s, leadership.check,
                          settings.egress_default)  # fmt: skip
    pools = Pools(store, settings.pools)
    builds = upkeep.TemplateBuilds(store, workers, sealer, leadership)
    reconciler = Reconciler(store, workers, listener, pools, sealer, leadership, cs,
                            settings.egress_default)  # fmt: skip
    webhooks = Webhooks(store, sealer, egress_floor(list(settings.webhook_open_networks)))
    meter = metering.Metering(store, workers, cs.usage_resolution_s)
    fine_for = timedelta(days=cs.usage_fine_days)
    loops: list[Callable[[], Awaitable[None]]] = [
        reconciler.run,
        partial(upkeep.every, 1.0, "drains", reconciler.moves.drain),
        partial(pools.run, listener),
        partial(upkeep.every, cs.probe_interval_s, "worker health", health.once),
        partial(upkeep.every, 1.0, "timeouts", partial(upkeep.timeouts, store)),
        partial(
            upkeep.every, cs.gc_interval_s, "gc", partial(upkeep.collect_garbage, store, workers)
        ),
        partial(upkeep.every, 1.0, "volumes", partial(upkeep.delete_volumes, store, workers)),
        partial(upkeep.every, 5.0, "volume pushes", partial(upkeep.push_volumes, store, workers)),
        partial(upkeep.every, 2.0, "volume moves", partial(upkeep.move_volumes, store, workers)),
        partial(upkeep.every, 60.0, "stale", partial(upkeep.stale_checkpoints, store, workers)),
        partial(upkeep.every, 0.5, "templates", builds.once),
        partial(upkeep.every, 0.5, "webhooks", webhooks.once),
        partial(upkeep.every, cs.usage_resolution_s, "metering", meter.once),
        partial(upkeep.every, 600.0, "usage roll-up", partial(metering.roll_up, store, fine_for)),
    ]
    tasks = [asyncio.ensure_future(leadership.hold()), *(asyncio.ensure_future(f()) for f in loops)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await webhooks.close()
        await listener.close()

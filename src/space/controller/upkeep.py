"""The periodic loops: sandbox timeouts, worker health and recovery, garbage collection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from space.db.store import Conflict, NotFound, Row, Store
from space.worker.client import WorkerClient, WorkerError

log = logging.getLogger(__name__)

TIMEOUT_ACTIONS = {"pause": ("paused", "pause"), "suspend": ("suspended", "suspend"),
                   "delete": ("deleted", "delete")}  # fmt: skip
LIVE = ("starting", "running", "pausing", "paused", "resuming", "suspending")
LOST = "worker {} lost: no heartbeat for {}s"


async def timeouts(store: Store) -> None:
    """Sandboxes past their timeout are paused, suspended or deleted, as each asked."""
    for row in await store.expired():
        desired, verb = TIMEOUT_ACTIONS.get(row["timeout_action"], ("paused", "pause"))
        try:
            await store.request(row["tenant_id"], row["id"], desired, ("running",), verb)
            log.info("sandbox %s timed out: %s", row["id"], verb)
        except (Conflict, NotFound):
            pass  # it changed meanwhile


async def worker_health(store: Store, workers: WorkerClient, dead_after_s: float) -> None:
    """Workers that stopped heartbeating lose their sandboxes (with a reason) until they return."""
    for worker_id in await store.mark_dead_workers(dead_after_s):
        log.warning("worker %s stopped heartbeating", worker_id)
        for row in await store.on_worker(worker_id):
            if row["state"] in LIVE:
                await store.transition(
                    row["id"], [row["state"]], "error",
                    reason=LOST.format(worker_id, dead_after_s), prev_state=row["state"],
                )  # fmt: skip
    for worker in await store.workers():
        if worker["state"] != "active":
            continue
        marker = f"worker {worker['id']} lost"
        lost = [
            r for r in await store.on_worker(worker["id"])
            if r["state"] == "error" and (r["reason"] or "").startswith(marker)
        ]  # fmt: skip
        if lost:
            await _recover(store, workers, worker["url"], lost)


async def _recover(store: Store, workers: WorkerClient, url: str, lost: list[Row]) -> None:
    """A worker is back: the VMs it re-adopted return to where they were; others are gone."""
    try:
        health = await workers.call("GET", f"{url}/health")
    except WorkerError as e:
        log.info("worker at %s not answering yet: %s", url, e)
        return
    found = {vm["id"]: vm["state"] for vm in health.get("vms", [])}
    for row in lost:
        vm_state = found.get(row["id"])
        if vm_state is not None:
            # A transition interrupted by the loss is driven again from the VM's real state.
            await store.transition(row["id"], ["error"], vm_state, reason=None, prev_state=None)
            log.info("sandbox %s recovered on its worker (%s)", row["id"], vm_state)
        else:
            await store.transition(
                row["id"], ["error"], "error",
                reason=f"the VM did not survive the loss of worker {row['worker_id']}",
                prev_state=None,
            )  # fmt: skip


async def collect_garbage(store: Store, workers: WorkerClient) -> None:
    """Each live worker drops the VMs and snapshots the database no longer wants."""
    for worker in await store.workers():
        if worker["state"] != "active":
            continue
        keep = [r["id"] for r in await store.on_worker(worker["id"])]
        try:
            result = await workers.call("POST", f"{worker['url']}/reconcile", json={"keep": keep})
        except WorkerError as e:
            log.info("garbage collection on %s skipped: %s", worker["id"], e)
            continue
        if result and result.get("removed"):
            log.info("worker %s removed strays: %s", worker["id"], result["removed"])


async def every(seconds: float, name: str, fn: Callable[[], Awaitable[None]]) -> None:
    """Run `fn()` forever, `seconds` apart; an error is logged, not fatal."""
    while True:
        try:
            await fn()
        except Exception:
            log.exception("%s failed", name)
        await asyncio.sleep(seconds)

"""The periodic loops: sandbox timeouts, worker health and recovery, garbage collection."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from space.db.sealing import Sealer, SealError
from space.db.store import Conflict, NotFound, Refused, Row, Store
from space.netpolicy import policy_for
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
            await store.request(
                row["tenant_id"], row["id"], desired, ("running",), verb, only_if_desired="running"
            )
            log.info("sandbox %s timed out: %s", row["id"], verb)
        except (Conflict, NotFound):
            pass  # it changed meanwhile


async def worker_health(
    store: Store, workers: WorkerClient, sealer: Sealer, dead_after_s: float
) -> None:
    """Workers that stopped heartbeating lose their sandboxes (with a reason) until they return;
    live workers are asked which VMs they really hold."""
    for worker_id in await store.mark_dead_workers(dead_after_s):
        log.warning("worker %s stopped heartbeating", worker_id)
    for worker in await store.workers():
        rows = await store.on_worker(worker["id"])
        if worker["state"] != "active":
            # Every pass, not only when the worker is found dead: a controller that died half-way,
            # or a placement that raced the verdict, must not leave sandboxes behind.
            for row in rows:
                if row["state"] in LIVE:
                    await store.transition(
                        row["id"], [row["state"]], "error",
                        reason=LOST.format(worker["id"], dead_after_s), prev_state=row["state"],
                    )  # fmt: skip
            continue
        await _verify(store, workers, sealer, worker, rows)


async def _verify(
    store: Store, workers: WorkerClient, sealer: Sealer, worker: Row, rows: list[Row]
) -> None:
    """Compare a live worker's VMs with its sandboxes in the database: the VMs a returning
    worker re-adopted go back to where they were; a running or paused sandbox whose VM is gone
    (or broken) is an error with the worker's reason."""
    url = worker["url"]
    marker = f"worker {worker['id']} lost"
    lost = [r for r in rows if r["state"] == "error" and (r["reason"] or "").startswith(marker)]
    settled = [r for r in rows if r["state"] in ("running", "paused")]
    try:
        health = await workers.call("GET", f"{url}/health")
    except WorkerError as e:
        log.info("worker at %s not answering: %s", url, e)
        return
    vms = {vm["id"]: vm for vm in health.get("vms", [])}
    for row in settled:
        vm = vms.get(row["id"])
        if vm is None or vm.get("state") == "error":
            why = (vm or {}).get("reason") or "its VM is gone from the worker"
            await store.transition(row["id"], [row["state"]], "error", reason=str(why),
                                   prev_state=row["state"])  # fmt: skip
    for row in settled:
        if vms.get(row["id"], {}).get("policy") is False:
            # The worker restarted and its VMs have been deny-all since: their policy again.
            try:
                policy = await policy_for(store, sealer, row)
                await workers.call(
                    "PUT", f"{url}/vms/{row['id']}/network", json=policy.model_dump()
                )
            except (Refused, SealError, WorkerError) as e:
                log.warning("sandbox %s: its egress policy not restored: %s", row["id"], e)
    found = {vm_id: vm["state"] for vm_id, vm in vms.items()}
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


async def _remove_on_worker(
    store: Store, workers: WorkerClient, worker_id: str | None, path: str
) -> bool:
    """DELETE `path` on the worker that holds a file (none: nothing to remove); False if that
    has to wait (the worker is away, or refused)."""
    worker = await store.worker(worker_id) if worker_id else None
    if worker is None:
        return True
    if worker["state"] != "active":
        return False  # the file is on that host: wait for the worker to come back
    try:
        await workers.call("DELETE", f"{worker['url']}{path}")
    except WorkerError as e:
        log.info("%s not removed yet: %s", path, e)
        return False
    return True


async def delete_volumes(store: Store, workers: WorkerClient) -> None:
    """Volumes asked to be deleted lose their image on their worker, then their row."""
    for vol in await store.volumes_to_delete():
        if await _remove_on_worker(store, workers, vol["worker_id"], f"/volumes/{vol['id']}"):
            await store.volume_deleted(vol["id"])


async def template_builds(store: Store, workers: WorkerClient) -> None:
    """Builds under way are asked how they did; deleted templates leave their worker once no
    sandbox of them is left."""
    for tpl in await store.templates_in("building"):
        worker = await store.worker(tpl["worker_id"])
        if worker is None or worker["state"] != "active":
            lost = f"worker {tpl['worker_id']} was lost during the build"
            await store.finish_build(tpl["id"], tpl["build_id"], None, lost)
            continue
        try:
            status = await workers.call("GET", f"{worker['url']}/builds/{tpl['build_id']}")
        except WorkerError as e:
            if e.status == 404:  # the worker restarted: the build died with it
                lost = "the build was lost when its worker restarted"
                await store.finish_build(tpl["id"], tpl["build_id"], None, lost)
            continue
        if status["state"] != "building":
            await store.finish_build(tpl["id"], tpl["build_id"], status["record"], status["error"])
    for tpl in await store.templates_in("deleting"):
        if await store.template_users(tpl["id"]):
            continue  # its pool members are still being deleted
        if await _remove_on_worker(store, workers, tpl["worker_id"], f"/templates/{tpl['id']}"):
            await store.forget_template(tpl["id"])


async def every(seconds: float, name: str, fn: Callable[[], Awaitable[None]]) -> None:
    """Run `fn()` forever, `seconds` apart; an error is logged, not fatal."""
    while True:
        try:
            await fn()
        except Exception:
            log.exception("%s failed", name)
        await asyncio.sleep(seconds)

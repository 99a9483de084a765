"""Drives every sandbox from its `state` to its `desired_state`, one step at a time.

Each step is a compare-and-set in the database around an idempotent worker call, so a
controller that dies between the two leaves a transitional state that the next leader simply
drives again. A worker that cannot be reached leaves the sandbox where it is, to be retried;
the health loop decides when a worker is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from functools import partial
from typing import Any

from space.controller.placement import pick_worker
from space.controller.pools import Pools
from space.db.listen import Listener
from space.db.sealing import Sealer, SealError
from space.db.store import Refused, Row, Store
from space.netpolicy import placeholder_env, policy_for
from space.worker.client import WorkerClient, WorkerError

log = logging.getLogger(__name__)

RESCAN_S = 1.0
RETRY_S = 1.0

# desired state → (transitional state, worker call, settled state)
STEPS: dict[str, tuple[str, str, str]] = {
    "paused": ("pausing", "pause", "paused"),
    "running": ("resuming", "resume", "running"),
    "suspended": ("suspending", "suspend", "suspended"),
}
FROM = {
    "paused": ("running",),
    "running": ("paused", "suspended"),
    "suspended": ("running", "paused"),
}


class Reconciler:
    def __init__(
        self, store: Store, workers: WorkerClient, listener: Listener, pools: Pools, sealer: Sealer
    ) -> None:
        self.sealer = sealer
        self.store = store
        self.workers = workers
        self.listener = listener
        self.pools = pools
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._placement = asyncio.Lock()

    async def run(self) -> None:
        wake = self.listener.subscribe()
        try:
            while True:
                wake.clear()
                for row in await self.store.sandboxes_to_reconcile():
                    sid = row["id"]
                    if sid not in self._inflight:
                        task = asyncio.ensure_future(self._drive(sid))
                        self._inflight[sid] = task
                        task.add_done_callback(partial(self._done, sid))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), RESCAN_S)
        finally:
            self.listener.unsubscribe(wake)
            for task in list(self._inflight.values()):
                task.cancel()

    def _done(self, sid: str, _task: asyncio.Task[None]) -> None:
        self._inflight.pop(sid, None)

    async def _drive(self, sid: str) -> None:
        try:
            for _ in range(8):  # a few steps at most, then back to the scan
                row = await self.store.get_sandbox(sid)
                if not await self._step(row):
                    return
        except WorkerError as e:
            if e.status == 0:
                log.info("sandbox %s: worker unreachable, will retry: %s", sid, e)
                await asyncio.sleep(RETRY_S)
            else:
                log.warning("sandbox %s: %s", sid, e)
        except Exception:
            log.exception("sandbox %s: reconcile step failed", sid)
            await asyncio.sleep(RETRY_S)

    async def _worker_url(self, row: Row) -> str | None:
        if not row["worker_id"]:
            return None
        worker = await self.store.worker(row["worker_id"])
        if worker is None or worker["state"] != "active":
            return None
        return f"{worker['url']}/vms/{row['id']}"

    async def _step(self, row: Row) -> bool:
        """One step toward the desired state; True if another step may follow at once."""
        sid, state, desired = row["id"], row["state"], row["desired_state"]
        if desired == "deleted":
            return await self._delete(row)
        if state == "pending":
            return await self._place(row)
        if state == "starting":
            return await self._start(row)
        if state in ("pausing", "resuming", "suspending"):
            return await self._finish(row, state)
        step = STEPS.get(desired)
        if step and state != desired and state in FROM[desired]:
            return await self.store.transition(sid, [state], step[0], prev_state=state) is not None
        return False

    async def _place(self, row: Row) -> bool:
        async with self._placement:
            workers = await self.store.workers()
            load = await self.store.worker_load()
            volumes = await self.store.sandbox_volumes(row)
            homes = {v["worker_id"] for v in volumes if v["worker_id"]}
            if home := await self.store.template_worker(row["template"]):
                homes.add(home)  # built there, and only there
            if len(homes) > 1:
                where = ", ".join(sorted(homes))
                why = f"its template and volumes live on different workers ({where})"
                await self.store.transition(row["id"], ["pending"], "error", reason=why)
                return False
            if homes:  # its template's or volumes' images are on one host: it must go there
                workers = [w for w in workers if w["id"] in homes]
            worker_id = pick_worker(workers, load, row["vcpus"], row["memory_mib"])
            if worker_id is None and row["pool"]:
                # A pool never waits for room: it only fills what real sandboxes leave free.
                await self.store.drop_pool_members([row["id"]], "no worker has room")
                return False
            if worker_id is None:
                # Warm-pool members give their room to a sandbox somebody asked for.
                if await self.pools.evict_for(row):
                    return False
                reason = "waiting for a worker with room"
                if row["reason"] != reason:
                    await self.store.transition(row["id"], ["pending"], "pending", reason=reason)
                return False
            if volumes:
                await self.store.bind_volumes([v["id"] for v in volumes], worker_id)
            return (
                await self.store.transition(row["id"], ["pending"], "starting", worker_id=worker_id)
                is not None
            )

    async def _start(self, row: Row) -> bool:
        url = await self._worker_url(row)
        if url is None:
            return False  # the health loop deals with sandboxes of dead workers
        try:
            policy = await policy_for(self.store, self.sealer, row)
        except (Refused, SealError) as e:
            await self.store.transition(row["id"], ["starting"], "error", reason=str(e))
            return False
        body: dict[str, Any] = {
            "template": row["template"],
            "vcpus": row["vcpus"],
            "memory_mib": row["memory_mib"],
            "disk_mib": row["disk_mib"],
            "env": {**row["env"], **placeholder_env(row["secrets"])},
            "network": policy.model_dump(),
            "hostname": row["id"],
            "warm": row["pool"],
            "volumes": [
                {k: v[k] for k in ("id", "size_mib", "path", "read_only")}
                for v in await self.store.sandbox_volumes(row)
            ],
        }
        try:
            made = await self.workers.call("PUT", url, json=body)
        except WorkerError as e:
            if e.status == 0:
                raise
            await self.store.transition(row["id"], ["starting"], "error", reason=e.detail)
            return False
        values: dict[str, Any] = {"boot": made.get("boot")}
        if row["pool"]:
            values["expires_at"] = None  # a pool member's timeout starts at its claim
        done = await self.store.transition(row["id"], ["starting"], "running", **values)
        if done is not None and row["pool"]:
            self.pools.refilled(done)
        return done is not None

    async def _finish(self, row: Row, state: str) -> bool:
        desired = row["desired_state"]
        step = STEPS.get(desired)
        if step is None or step[0] != state:
            # The wish changed mid-way (e.g. delete while pausing); settle this step first.
            step = next(s for s in STEPS.values() if s[0] == state)
        url = await self._worker_url(row)
        if url is None:
            return False
        try:
            await self.workers.call("POST", f"{url}/{step[1]}")
        except WorkerError as e:
            if e.status == 0:
                raise
            # The worker refused the step: the VM is still as it was, so the sandbox goes back
            # to where it came from (and stops asking), with the reason; it stays usable.
            back = row["prev_state"]
            if back in ("running", "paused", "suspended"):
                await self.store.transition(
                    row["id"], [state], back, reason=f"{step[1]} failed: {e.detail}",
                    desired_state=back, prev_state=None,
                )  # fmt: skip
            else:
                await self.store.transition(row["id"], [state], "error", reason=e.detail)
            return False
        return await self.store.transition(row["id"], [state], step[2]) is not None

    async def _delete(self, row: Row) -> bool:
        sid, state = row["id"], row["state"]
        if state == "deleted":
            return False
        if state != "deleting":
            return await self.store.transition(sid, [state], "deleting") is not None
        url = await self._worker_url(row)
        if url is not None:
            try:
                await self.workers.call("DELETE", url)
            except WorkerError as e:
                if e.status not in (404,):
                    raise
        # Without a live worker there is nothing to stop now; the worker's own clean-up removes
        # the VM and disk when it comes back (it keeps only what the database still wants).
        await self.store.transition(sid, ["deleting"], "deleted")
        return False

"""Drives every sandbox from its `state` to its `desired_state`, one step at a time.

Each step is a compare-and-set in the database around an idempotent worker call, and nothing
holds a transaction across that call: a controller that dies between the two leaves a
transitional state that the next leader simply drives again. Every call carries the leader's
epoch and every write is fenced by it, so a leader that lost its lease cannot act. A worker that
cannot be reached leaves the sandbox where it is, to be retried; the health loop decides when a
worker is lost.

The same path carries policy changes (the API bumps `network_version`; a running sandbox gets
the new policy from here) and reboots (the health loop puts a sandbox whose VMM died back to
`starting`; the worker boots it again from its own disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from functools import partial
from typing import Any

from space import logs, tracing
from space.controller.leader import Leadership, LostLeadership
from space.controller.moves import Moves
from space.controller.placement import Need, holding, pick_worker, why_not
from space.controller.pools import Pools
from space.db.listen import Listener
from space.db.sealing import Sealer, SealError
from space.db.store import NotFound, Refused, Row, Store
from space.netpolicy import Default, placeholder_env, policy_for
from space.settings import ControllerSettings
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import CreateVM, TemplateBuild, VolumeSpec

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
        self,
        store: Store,
        workers: WorkerClient,
        listener: Listener,
        pools: Pools,
        sealer: Sealer,
        leadership: Leadership,
        settings: ControllerSettings,
        egress_default: Default,
    ) -> None:
        self.sealer = sealer
        self.egress_default: Default = egress_default
        self.store = store
        self.workers = workers
        self.listener = listener
        self.pools = pools
        self.leadership = leadership
        self.settings = settings
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._deleting: dict[str, asyncio.Task[None]] = {}  # deletes beside a step in flight
        self._driving_to: dict[str, str] = {}  # what each task in flight was started toward
        self._placement = asyncio.Lock()
        self.moves = Moves(store, workers, sealer, leadership.check, self._placement)
        self._lost: LostLeadership | None = None
        self._wake = asyncio.Event()

    async def run(self) -> None:
        """Until cancelled, or until leadership is lost (LostLeadership)."""
        wake = self._wake = self.listener.subscribe()
        try:
            while True:
                wake.clear()
                if self._lost is not None:
                    raise self._lost
                self.leadership.check()
                try:
                    rows = await self.store.sandboxes_to_reconcile()
                except Exception as e:  # the database is away: look again in a moment
                    log.warning("sandboxes to reconcile not read: %s", e)
                    rows = []
                for row in rows:
                    sid = row["id"]
                    if sid not in self._inflight:
                        task = asyncio.ensure_future(self._drive(sid))
                        self._inflight[sid] = task
                        self._driving_to[sid] = row["desired_state"]
                        task.add_done_callback(partial(self._done, sid))
                    elif (row["desired_state"] == "deleted" and sid not in self._deleting
                          and self._driving_to.get(sid) != "deleted"):  # fmt: skip
                        # A delete never waits behind a step in flight (a suspend of a VMM that
                        # stopped answering): it goes to the worker at once, which ends that
                        # step; the step's own writes then find the row moved on.
                        task = asyncio.ensure_future(self._drive(sid))
                        self._deleting[sid] = task
                        task.add_done_callback(partial(self._deleted, sid))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), RESCAN_S)
        finally:
            self.listener.unsubscribe(wake)
            for task in [*self._inflight.values(), *self._deleting.values()]:
                task.cancel()

    def _stop(self, e: LostLeadership) -> None:
        self._lost = e
        self._wake.set()

    def _done(self, sid: str, _task: asyncio.Task[None]) -> None:
        self._inflight.pop(sid, None)
        self._driving_to.pop(sid, None)

    def _deleted(self, sid: str, _task: asyncio.Task[None]) -> None:
        self._deleting.pop(sid, None)

    async def _drive(self, sid: str) -> None:
        try:
            for _ in range(8):  # a few steps at most, then back to the scan
                row = await self.store.get_sandbox(sid)
                if not await self._step(row):
                    return
        except LostLeadership as e:
            self._stop(e)
        except WorkerError as e:
            if e.status == 412:
                self._stop(LostLeadership(e.detail))
            elif e.status == 0:
                log.info("sandbox %s: worker unreachable, will retry: %s", sid, e)
                await asyncio.sleep(RETRY_S)
            else:
                log.warning("sandbox %s: %s", sid, e)
        except Exception:
            log.exception("sandbox %s: reconcile step failed", sid)
            await asyncio.sleep(RETRY_S)

    async def _worker(self, row: Row) -> Worker | None:
        if not row["worker_id"]:
            return None
        worker = await self.store.worker(row["worker_id"])
        if worker is None or worker["state"] != "active":
            return None
        return Worker(worker["id"], worker["url"])

    async def _to(self, row: Row, states: list[str], to: str, **values: Any) -> Row | None:
        return await self.store.transition(
            row["id"], states, to, fence=self.leadership.check(), **values
        )

    async def _step(self, row: Row) -> bool:
        """One step toward the desired state; True if another step may follow at once."""
        # This task's lines are about this sandbox, for the request that asked for its state,
        # and its spans join that request's trace.
        logs.bind(request_id=row["request_id"], tenant=row["tenant_id"], sandbox=row["id"],
                  worker=row["worker_id"])  # fmt: skip
        name = f"reconcile {row['state']} to {row['desired_state']}"
        with tracing.continued(name, row["trace_parent"], space__sandbox_id=row["id"],
                               space__request_id=row["request_id"]):  # fmt: skip
            return await self._next(row)

    async def _next(self, row: Row) -> bool:
        state, desired = row["state"], row["desired_state"]
        if desired == "deleted":
            return await self._delete(row)
        if state == "claiming":
            return await self._stale_claim(row)
        if state == "pending":
            return await self._place(row)
        if state == "starting":
            return await self._start(row)
        if state in ("pausing", "resuming", "suspending"):
            return await self._finish(row, state)
        if state in ("running", "paused") and row["network_applied"] < row["network_version"]:
            await self._push_network(row)
        step = STEPS.get(desired)
        if step and state != desired and state in FROM[desired]:
            if state == "suspended" and desired == "running":
                moved = await self.moves.relocate(row)  # its worker may be gone
                if moved is None:
                    return False
                row = moved
            return await self._to(row, [state], step[0], prev_state=state) is not None
        return False

    async def _stale_claim(self, row: Row) -> bool:
        """A claim the API did not finish in time (it died between its steps): dropped."""
        age = (datetime.now(UTC) - row["updated_at"]).total_seconds()
        if age > self.settings.claim_grace_s:
            log.warning("sandbox %s: claim not confirmed in %.0f s; dropping it", row["id"], age)
            await self.store.abandon_claim(row["id"], None, "its claim was never confirmed")
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
                await self._to(row, ["pending"], "error", reason=why)
                return False
            if homes:  # its template's or volumes' images are on one host: it must go there
                workers = [w for w in workers if w["id"] in homes]
            need = Need(row["vcpus"], row["memory_mib"], row["disk_mib"])
            record = await self.store.template_record(row["template"])
            prefer = holding(workers, row["template"], record)
            if (record or {}).get("artifact"):  # pulled where it is not: by workers that can
                workers = [w for w in workers if w["registry"] or w["id"] in prefer]
            worker_id = pick_worker(workers, load, need, prefer=prefer)
            if worker_id is None and row["pool"]:
                # A pool never waits for room: it only fills what real sandboxes leave free.
                await self.store.drop_pool_members([row["id"]], "no worker has room")
                return False
            if worker_id is None:
                # Warm-pool members give their room to a sandbox somebody asked for.
                if evicted := await self.pools.evict_for(row):
                    reason = f"waiting for room: {evicted}"
                else:
                    reason = f"waiting for a worker with room: {why_not(workers, load, need)}"
                if row["reason"] != reason:
                    await self._to(row, ["pending"], "pending", reason=reason)
                return False
            if volumes:
                await self.store.bind_volumes([v["id"] for v in volumes], worker_id)
            logs.bind(worker=worker_id)
            log.info("sandbox %s placed on worker %s", row["id"], worker_id)
            return await self._to(row, ["pending"], "starting", worker_id=worker_id) is not None

    async def _start(self, row: Row) -> bool:
        worker = await self._worker(row)
        if worker is None:
            return False  # the health loop deals with sandboxes of lost workers
        try:
            policy = await policy_for(self.store, self.sealer, row, self.egress_default)
        except (Refused, SealError) as e:
            await self._to(row, ["starting"], "error", reason=str(e))
            return False
        record = await self.store.template_record(row["template"]) or {}
        volumes = await self.store.sandbox_volumes(row)
        body = CreateVM(
            template=row["template"],
            # In the registry: the worker pulls it first if it does not hold that build.
            template_build=TemplateBuild(digest=record["digest"], artifact=record["artifact"])
            if record.get("artifact")
            else None,
            vcpus=row["vcpus"],
            memory_mib=row["memory_mib"],
            disk_mib=row["disk_mib"],
            env={**row["env"], **placeholder_env(row["secrets"])},
            network=policy,
            hostname=row["id"],
            warm=row["pool"],
            # A volume in the registry is pulled by a worker whose copy is not that one.
            volumes=[VolumeSpec(**{k: v[k] for k in VolumeSpec.model_fields}) for v in volumes],
        )
        try:
            made = await self.workers.create_vm(worker, row["id"], body)
        except WorkerError as e:
            if e.status in (0, 412, 503):
                raise  # unreachable, not the leader any more, or not now: retried
            if e.code == "volume_in_use" and await self._reap_holders(row, worker, e.holders):
                return False  # tried again at the next scan, once the holders are gone
            await self._to(row, ["starting"], "error", reason=e.detail)
            return False
        log.info("sandbox %s running on worker %s (%s, %.0f ms there)", row["id"], worker.id,
                 made.boot, made.took_ms)  # fmt: skip
        values: dict[str, Any] = {"network_applied": row["network_version"], "reason": None}
        if row["boot"] is None:
            values["boot"] = made.boot  # how it first came to run (a reboot keeps it)
        if row["pool"]:
            values["expires_at"] = None  # a pool member's timeout starts at its claim
        done = await self._to(row, ["starting"], "running", **values)
        if done is not None and row["pool"] and row["boot"] is None:
            self.pools.refilled(done)
        return done is not None

    async def _reap_holders(self, row: Row, worker: Worker, holders: list[str]) -> bool:
        """A volume the database gave this sandbox is still held on its worker by VMs the
        database wants gone (deleted while that worker was away): have the worker end them, and
        let the sandbox wait, saying why. False if a holder is one the database still wants:
        then two writers would be asked for, and the sandbox fails."""
        if not holders:
            return False
        for holder in holders:
            try:
                other = await self.store.get_sandbox(holder)
            except NotFound:
                continue  # not the database's at all: the worker holds what nobody wants
            if other["desired_state"] != "deleted":
                return False
        reason = (f"waiting for its volumes: still attached on worker {worker.id} to "
                  f"{', '.join(holders)}, which are being removed")  # fmt: skip
        if row["reason"] != reason:
            await self._to(row, ["starting"], "starting", reason=reason)
        for holder in holders:
            try:
                await self.workers.delete_vm(worker, holder)
            except WorkerError as e:
                if e.status != 404:
                    log.warning("sandbox %s: %s not removed from %s: %s", row["id"], holder,
                                worker.id, e)  # fmt: skip
        return True

    async def _push_network(self, row: Row, worker: Worker | None = None) -> None:
        """Put the sandbox's current egress policy in force on its worker."""
        worker = worker or await self._worker(row)
        if worker is None:
            return
        try:
            policy = await policy_for(self.store, self.sealer, row, self.egress_default)
        except (Refused, SealError) as e:
            log.warning("sandbox %s: its new policy cannot be built: %s", row["id"], e)
            return
        await self.workers.set_network(worker, row["id"], policy)
        await self.store.network_applied(row["id"], row["network_version"],
                                         self.leadership.check())  # fmt: skip

    async def _finish(self, row: Row, state: str) -> bool:
        desired = row["desired_state"]
        step = STEPS.get(desired)
        if step is None or step[0] != state:
            # The wish changed mid-way (e.g. delete while pausing); settle this step first.
            step = next(s for s in STEPS.values() if s[0] == state)
        worker = await self._worker(row)
        if worker is None:
            return False
        try:
            if step[1] == "resume" and row["prev_state"] == "suspended":
                # A suspended VM's worker holds no policy (nor its secrets): it gets it now.
                await self._push_network(row, worker)
            done = await self.workers.change_vm(worker, row["id"], step[1])
        except WorkerError as e:
            if e.status in (0, 412, 503):
                raise
            # The worker refused the step: the VM is still as it was, so the sandbox goes back
            # to where it came from (and stops asking), with the reason; it stays usable.
            back = row["prev_state"]
            if back in ("running", "paused", "suspended"):
                await self._to(
                    row, [state], back, reason=f"{step[1]} failed: {e.detail}",
                    desired_state=back, prev_state=None,
                )  # fmt: skip
            else:
                await self._to(row, [state], "error", reason=e.detail)
            return False
        log.info("sandbox %s %s on worker %s: done", row["id"], step[1], worker.id)
        # Suspended: where its snapshot went, if it went to the registry; running: none.
        values = {"artifact": done.artifact} if step[1] in ("suspend", "resume") else {}
        return await self._to(row, [state], step[2], **values) is not None

    async def _delete(self, row: Row) -> bool:
        sid, state = row["id"], row["state"]
        if state == "deleted":
            return False
        if state != "deleting":
            return await self._to(row, [state], "deleting") is not None
        worker = await self._worker(row)
        if worker is not None:
            try:
                await self.workers.delete_vm(worker, sid)
            except WorkerError as e:
                if e.status != 404:
                    raise
        # Without a live worker there is nothing to stop now; the worker's own clean-up removes
        # the VM and disk when it comes back (it keeps only what the database still wants).
        await self._to(row, ["deleting"], "deleted")
        log.info("sandbox %s deleted", sid)
        return False

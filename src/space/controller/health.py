"""Worker liveness and what each worker's VMs really are, by the leader's own probes.

Every second the leader asks every worker for its health, all at once, each with a deadline of
its own, so one slow or frozen worker delays nobody. A worker that has not answered for
`worker_lost_after_s`, and to at least two probes in a row (a leader that itself stalled has not
seen its workers fall silent), is lost: its sandboxes show it (state `error`, why, and the state
they were in); when it answers again they go back to the states its VMs report. Liveness is the
probes', not the database's: a database outage stops nothing here and kills no worker, and a
new leader starts every worker's clock afresh.

For a live worker, each sandbox is compared with its VM: a VM whose VMM died is booted again
from its own disk (its files are kept, its processes are not; the reason says so); a VM that
does not answer, or that an I/O error stopped, is an error until it recovers; a VM the worker
no longer has is lost; a VM whose egress policy died with an earlier worker process gets it
again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from space.controller.leader import LostLeadership
from space.db.sealing import Sealer, SealError
from space.db.store import Conflict, NotFound, Refused, Row, Store
from space.netpolicy import Default, policy_for
from space.release import refusal
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import Health, VMReport

log = logging.getLogger(__name__)

LOST_PROBES = 2
LIVE = ("starting", "running", "pausing", "paused", "resuming", "suspending")
REBOOT = "its VM stopped ({}); booting it again from its own disk: files are kept, running " \
         "processes are lost"  # fmt: skip


class WorkerHealth:
    def __init__(
        self,
        store: Store,
        workers: WorkerClient,
        sealer: Sealer,
        lost_after_s: float,
        epoch: Callable[[], int],
        egress_default: Default,
    ) -> None:
        self.store = store
        self.workers = workers
        self.sealer = sealer
        self.egress_default: Default = egress_default
        self.lost_after_s = lost_after_s
        self.epoch = epoch  # the leader's, checked before every write
        self._known: list[Row] = []
        self._ok: dict[str, float] = {}  # worker id → when it last answered (monotonic)
        self._missed: dict[str, int] = {}  # worker id → probes unanswered since
        self._started = time.monotonic()

    async def once(self) -> None:
        try:
            self._known = await self.store.workers()
        except Exception as e:  # the database is away: keep probing the workers we know
            log.warning("workers not listed (%s); probing the last known ones", e)
        results = await asyncio.gather(
            *(self._probe(w) for w in self._known), return_exceptions=True
        )
        for w, result in zip(self._known, results, strict=True):
            if isinstance(result, LostLeadership):
                raise result
            if isinstance(result, BaseException):
                log.warning("health of worker %s not handled: %r", w["id"], result)

    async def _probe(self, w: Row) -> None:
        worker = Worker(w["id"], w["url"])
        # Its sandboxes as they were before the probe: a VM absent from the answer that follows
        # is really gone (read after it, a create finished meanwhile would look like a loss).
        try:
            rows: list[Row] | None = await self.store.on_worker(w["id"])
        except Exception as e:
            log.warning(
                "sandboxes of worker %s not read (%s): only its liveness is checked", w["id"], e
            )
            rows = None
        asked = time.monotonic()
        try:
            health = await self.workers.health(worker)
        except WorkerError as e:
            if e.status == 412:
                raise LostLeadership(f"worker {w['id']} heard from a newer leader") from None
            await self._unanswered(w, str(e))
            return
        self._ok[w["id"]] = time.monotonic()
        self._missed[w["id"]] = 0
        if rows is None:
            return
        if w["state"] != "active":
            log.info("worker %s answers again", w["id"])
            await self.store.set_worker_state(w["id"], "active")
        # A worker of a release this one does not work with takes no work (it says why).
        problems = [*health.problems, *filter(None, [refusal(health.version, "worker")])]
        await self.store.worker_health(
            w["id"], health.overhead_mib, health.used.memory_mib,
            (health.capacity.disk_mib, health.used.disk_mib),
            "; ".join(problems) or None, time.monotonic() - asked,
            health.mem_available_mib, health.templates, health.registry,
            health.shares.model_dump(), health.version,
        )  # fmt: skip
        await self._verify(worker, health, rows)

    async def _unanswered(self, w: Row, why: str) -> None:
        last = self._ok.get(w["id"], self._started)
        silent = time.monotonic() - last
        self._missed[w["id"]] = missed = self._missed.get(w["id"], 0) + 1
        if silent < self.lost_after_s or missed < LOST_PROBES:
            return
        if w["state"] == "active":
            log.warning("worker %s lost: no answer for %.0f s (%s)", w["id"], silent, why)
            await self.store.set_worker_state(w["id"], "lost")
        reason = f"worker {w['id']} lost: no answer for {silent:.0f} s"
        for row in await self.store.on_worker(w["id"]):
            if row["state"] in LIVE:
                await self.store.transition(
                    row["id"], [row["state"]], "error", reason=reason, prev_state=row["state"],
                    fence=self.epoch(),
                )  # fmt: skip

    async def _verify(self, worker: Worker, health: Health, rows: list[Row]) -> None:
        vms = {vm.id: vm for vm in health.vms}
        for row in rows:
            vm = vms.get(row["id"])
            if row["state"] in ("running", "paused"):
                await self._settled(worker, row, vm)
            elif row["state"] == "error" and row["prev_state"]:
                await self._recovered(row, vm)
            elif row["state"] == "suspended" and vm is None:
                await self._transition(row, "error", "its snapshot is gone from the worker")

    async def _settled(self, worker: Worker, row: Row, vm: VMReport | None) -> None:
        if vm is None:
            await self._transition(row, "error", "its VM is gone from the worker")
        elif vm.crashed and not row["pool"]:
            await self._transition(row, "starting", REBOOT.format(vm.reason or "its VMM died"),
                                   prev_state=row["state"])  # fmt: skip
        elif vm.state in ("error", "unresponsive"):
            # (A warm-pool member is not worth a reboot: it is dropped and replaced.)
            await self._transition(row, "error", vm.reason or f"its VM is {vm.state}",
                                   prev_state=row["state"])  # fmt: skip
        elif not vm.policy:
            # The worker restarted and its VMs have been deny-all since: their policy again.
            try:
                policy = await policy_for(self.store, self.sealer, row, self.egress_default)
                await self.workers.set_network(worker, row["id"], policy)
            except (Refused, SealError, WorkerError) as e:
                log.warning("sandbox %s: its egress policy not restored: %s", row["id"], e)
        elif _idle_past(row, vm):
            await self._pause_idle(row, vm.idle_s)

    async def _pause_idle(self, row: Row, idle_s: float) -> None:
        """The idle policy: a sandbox nobody used for its idle timeout is paused; its next
        exec, file call or ingress resumes it (the API does)."""
        try:
            await self.store.request(
                row["tenant_id"], row["id"], "paused", ("running",), "pause",
                only_if_desired="running", idle=True, reason=f"idle for {idle_s:.0f} s",
            )  # fmt: skip
            log.info("sandbox %s paused: idle for %.0f s", row["id"], idle_s)
        except (Conflict, NotFound):
            pass  # it changed meanwhile

    async def _recovered(self, row: Row, vm: VMReport | None) -> None:
        """An error the worker or its VM came back from: the sandbox is as its VM is."""
        if vm is None and row["boot"] is None and not row["pool"]:
            # Lost while it was first being made: nothing of the tenant's was in it yet, so it
            # is made again (wherever there is room) rather than left in error.
            why = f"made again: worker {row['worker_id']} was lost while it was being made"
            await self._transition(row, "pending", why, from_state="error", prev_state=None,
                                   worker_id=None)  # fmt: skip
        elif vm is None:
            why = f"the VM did not survive the loss of worker {row['worker_id']}"
            await self._transition(row, "error", why, from_state="error", prev_state=None)
        elif vm.crashed:
            await self._transition(row, "starting", REBOOT.format(vm.reason or "its VMM died"),
                                   from_state="error")  # fmt: skip
        elif vm.state in ("running", "paused", "suspended"):
            await self._transition(row, vm.state, None, from_state="error", prev_state=None)
            log.info("sandbox %s recovered on its worker (%s)", row["id"], vm.state)

    async def _transition(
        self, row: Row, to: str, reason: str | None, from_state: str | None = None, **values: Any
    ) -> None:
        # Only while it is still on the worker probed: a move may have taken it elsewhere since.
        await self.store.transition(
            row["id"], [from_state or row["state"]], to, reason=reason, fence=self.epoch(),
            where_worker=row["worker_id"], **values,
        )  # fmt: skip


def _idle_past(row: Row, vm: VMReport) -> bool:
    timeout = row["idle_timeout_s"]
    return (timeout is not None and not row["pool"] and row["state"] == "running"
            and row["desired_state"] == "running" and vm.state == "running"
            and vm.idle_s >= timeout)  # fmt: skip

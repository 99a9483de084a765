"""Sandboxes that leave their worker.

A suspended sandbox whose snapshot is in the registry resumes on another worker when its own is
lost or being drained: the other worker pulls it (`adopt`), and only then does the database say
it lives there. One whose snapshot is only on its worker waits for that worker, saying so.

Draining a worker (`space admin drain`): placement sends it nothing new; its pool members are
let go (the pools refill elsewhere); its running sandboxes are suspended (their `desired_state`
stays running, so each then resumes on another worker) and its paused ones suspended (they
resume elsewhere when asked). A sandbox with volumes stays, as does every sandbox of a worker
that pushes nothing to a registry: their files are that host's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from space.controller.leader import LostLeadership
from space.controller.placement import Need, pick_worker, why_not
from space.db.sealing import Sealer, SealError
from space.db.store import Refused, Row, Store
from space.netpolicy import policy_for
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import AdoptVM

log = logging.getLogger(__name__)


class Moves:
    def __init__(
        self, store: Store, workers: WorkerClient, sealer: Sealer, epoch: Callable[[], int],
        placement: asyncio.Lock,
    ) -> None:  # fmt: skip
        self.store = store
        self.workers = workers
        self.sealer = sealer
        self.epoch = epoch  # the leader's, checked before every write
        self.placement = placement  # the reconciler's: one placement decision at a time

    async def _say(self, row: Row, reason: str) -> None:
        if row["reason"] != reason:
            await self.store.transition(row["id"], [row["state"]], row["state"], reason=reason,
                                        fence=self.epoch())  # fmt: skip

    async def relocate(self, row: Row) -> Row | None:
        """The suspended sandbox's row on a worker that can resume it: its own, or another
        that pulled it first; None while it has to wait (its reason says for what)."""
        w = await self.store.worker(row["worker_id"]) if row["worker_id"] else None
        usable = w is not None and w["state"] == "active"
        if usable and not w["draining"]:  # type: ignore[index]
            return row
        why = "is being drained" if usable else "is lost"
        if not row["artifact"]:
            if usable:
                return row  # drained, but its snapshot cannot leave: it resumes there
            await self._say(row, f"waiting for worker {row['worker_id']}, which {why}: its "
                            "snapshot is only there")  # fmt: skip
            return None
        async with self.placement:
            workers = [x for x in await self.store.workers() if x["id"] != row["worker_id"]]
            load = await self.store.worker_load()
            need = Need(row["vcpus"], row["memory_mib"], row["disk_mib"])
            target = pick_worker(workers, load, need)
        if target is None:
            await self._say(row, f"worker {row['worker_id']} {why}; waiting for another with "
                            f"room: {why_not(workers, load, need)}")  # fmt: skip
            return None
        to = next(x for x in workers if x["id"] == target)
        try:
            policy = await policy_for(self.store, self.sealer, row)
        except (Refused, SealError) as e:
            await self._say(row, f"not moved: {e}")
            return None
        try:
            body = AdoptVM(artifact=row["artifact"], network=policy)
            await self.workers.adopt_vm(Worker(to["id"], to["url"]), row["id"], body)
        except WorkerError as e:
            if e.status == 412:
                raise LostLeadership(e.detail) from None
            if e.status in (0, 503):
                raise  # the target or the registry is away: tried again
            await self._say(row, f"not moved to worker {target}: {e.detail}")
            return None
        log.info("sandbox %s moved from worker %s to %s", row["id"], row["worker_id"], target)
        return await self.store.transition(
            row["id"], ["suspended"], "suspended", worker_id=target, fence=self.epoch(),
            reason=f"moved to worker {target}: worker {row['worker_id']} {why}",
        )  # fmt: skip

    async def drain(self) -> None:
        """One pass over every worker being drained."""
        for w in await self.store.workers():
            if not w["draining"] or w["state"] != "active":
                continue
            rows = await self.store.on_worker(w["id"])
            members = [r["id"] for r in rows if r["pool"] and r["state"] != "deleting"]
            if members:
                await self.store.drop_pool_members(members, f"worker {w['id']} is being drained")
            if not w["registry"]:
                continue
            for r in rows:
                if r["pool"] or r["volumes"] or r["desired_state"] != r["state"]:
                    continue
                if r["state"] == "suspended" and r["artifact"]:
                    await self.relocate(r)  # moved now, resumed when asked
                    continue
                if r["state"] not in ("running", "paused"):
                    continue
                # A running one resumes elsewhere at once; a paused one when it is asked to.
                desired = "running" if r["state"] == "running" else "suspended"
                await self.store.transition(
                    r["id"], [r["state"]], "suspending", prev_state=r["state"],
                    desired_state=desired, fence=self.epoch(),
                    reason=f"moving off worker {w['id']}, which is being drained",
                )  # fmt: skip


def to_move(worker: Row, rows: list[Row]) -> tuple[list[str], dict[str, str]]:
    """Of the sandboxes placed on a drained worker: those still to leave it, and those that
    stay, each with why."""
    leaving, staying = [], {}
    for r in rows:
        if r["state"] in ("deleted", "deleting", "error"):
            continue
        if r["pool"]:
            leaving.append(r["id"])
        elif r["volumes"]:
            staying[r["id"]] = "its volumes are on this host"
        elif not worker["registry"]:
            staying[r["id"]] = "the worker pushes nothing to a registry"
        elif r["state"] == "suspended" and not r["artifact"]:
            staying[r["id"]] = "its snapshot is only on this host"
        else:
            leaving.append(r["id"])
    return leaving, staying

"""Sandboxes that leave their worker.

A suspended sandbox whose snapshot is in the registry resumes on another worker when its own is
lost or being drained: the other worker pulls it (`adopt`), and only then does the database say
it lives there. One whose snapshot is only on its worker waits for that worker, saying so.

Draining a worker (`space admin drain`): placement sends it nothing new; its pool members are
let go (the pools refill elsewhere); its running sandboxes are suspended (their `desired_state`
stays running, so each then resumes on another worker) and its paused ones suspended (they
resume elsewhere when asked). A sandbox with volumes or checkpoints stays, as does every
sandbox of a worker that pushes nothing to a registry, and one whose snapshot could not be
pushed (it resumes where it is, and the drain leaves it alone): their files are that host's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from space.controller.leader import LostLeadership
from space.controller.placement import Need, pick_worker, why_not
from space.db.sealing import Sealer
from space.db.store import Row, Store
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
        self.stuck: set[str] = set()  # sandboxes a drain found could not leave: left alone

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
        checkpointed = await self.store.with_checkpoints([row["id"]])
        stays = why_it_stays(w, row, checkpointed) if w is not None else None
        if stays is None and not row["artifact"]:
            stays = "its snapshot is only on this host"
        if stays is not None:
            if usable:
                self.stuck.add(row["id"])  # a drain must not suspend it again and again
                return row  # drained, but it cannot leave: it resumes there
            await self._say(row, f"waiting for worker {row['worker_id']}, which {why}: {stays}")
            return None
        async with self.placement:
            workers = [x for x in await self.store.workers()
                       if x["id"] != row["worker_id"] and x["registry"]]  # fmt: skip
            load = await self.store.worker_load()
            need = Need(row["vcpus"], row["memory_mib"], row["disk_mib"])
            target = pick_worker(workers, load, need)
        if target is None:
            await self._say(row, f"worker {row['worker_id']} {why}; waiting for another with "
                            f"room: {why_not(workers, load, need)}")  # fmt: skip
            return None
        to = next(x for x in workers if x["id"] == target)
        try:
            # No policy goes with it: the resume sends it (a worker holds no secrets of a
            # sandbox that is not running there).
            body = AdoptVM(artifact=row["artifact"])
            await self.workers.adopt_vm(Worker(to["id"], to["url"]), row["id"], body)
        except WorkerError as e:
            if e.status == 412:
                raise LostLeadership(e.detail) from None
            await self._say(row, f"not moved to worker {target} yet: {e.detail}")
            if e.status in (0, 503):
                raise  # the target or the registry is away: tried again
            return None
        log.info("sandbox %s moved from worker %s to %s", row["id"], row["worker_id"], target)
        return await self.store.transition(
            row["id"], ["suspended"], "suspended", worker_id=target, fence=self.epoch(),
            reason=f"moved to worker {target}: worker {row['worker_id']} {why}",
            where_worker=row["worker_id"],
        )  # fmt: skip

    async def drain(self) -> None:
        """One pass over every worker being drained; one sandbox that fails does not stop the
        rest."""
        for w in await self.store.workers():
            if not w["draining"] or w["state"] != "active":
                continue
            rows = await self.store.on_worker(w["id"])
            members = [r["id"] for r in rows if r["pool"] and r["state"] != "deleting"]
            if members:
                await self.store.drop_pool_members(members, f"worker {w['id']} is being drained")
            leaving, _ = to_move(
                w, rows, await self.store.with_checkpoints([r["id"] for r in rows])
            )
            for r in rows:
                if r["id"] not in leaving or r["id"] in self.stuck or r["pool"]:
                    continue
                try:
                    await self._drain_one(w, r)
                except LostLeadership:
                    raise
                except Exception as e:  # tried again at the next pass
                    log.warning("sandbox %s not moved off worker %s: %s", r["id"], w["id"], e)

    async def _drain_one(self, w: Row, r: Row) -> None:
        if r["desired_state"] != r["state"] or (r["reason"] or "").startswith("suspend failed"):
            return  # busy, or it refused once: it stays
        if r["state"] == "suspended":
            await self.relocate(r)  # moved now, resumed when asked
        elif r["state"] in ("running", "paused"):
            # A running one resumes elsewhere at once; a paused one when it is asked to.
            desired = "running" if r["state"] == "running" else "suspended"
            await self.store.transition(
                r["id"], [r["state"]], "suspending", prev_state=r["state"],
                desired_state=desired, fence=self.epoch(), where_worker=w["id"],
                where_desired=r["desired_state"],
                reason=f"moving off worker {w['id']}, which is being drained",
            )  # fmt: skip


def to_move(
    worker: Row, rows: list[Row], checkpointed: set[str]
) -> tuple[list[str], dict[str, str]]:
    """Of the sandboxes placed on a drained worker: those still to leave it, and those that
    stay, each with why."""
    leaving, staying = [], {}
    for r in rows:
        if r["state"] in ("deleted", "deleting", "error"):
            continue
        if (why := why_it_stays(worker, r, checkpointed)) is not None:
            staying[r["id"]] = why
        else:
            leaving.append(r["id"])
    return leaving, staying


def why_it_stays(worker: Row, row: Row, checkpointed: Collection[str]) -> str | None:
    """Why a sandbox cannot leave its worker, if it cannot (a pool member always can)."""
    if row["pool"]:
        return None
    if row["volumes"]:
        return "its volumes are on this host"
    if row["id"] in checkpointed:
        return "its checkpoints are on this host"
    if not worker["registry"]:
        return "the worker pushes nothing to a registry"
    if row["state"] == "suspended" and not row["artifact"]:
        return "its snapshot is only on this host"
    return None

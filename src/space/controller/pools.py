"""Warm pools: per template, keep `pool_size` sandboxes restored, running and unclaimed.

Members are ordinary sandbox rows owned by the pool tenant, so the reconciler places, starts
and deletes them like any other; this loop only decides how many there should be. It never
runs code in a member: the first command a member runs is its claimer's.

- A pool fills only the room real sandboxes leave free, and gives it back: a sandbox waiting
  for room evicts members (`evict_for`), and a worker whose host runs short of memory loses
  its members one per pass.
- Broken members (their VM died, or a claim failed) are deleted and replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from prometheus_client import Counter as Metric
from prometheus_client import Gauge, Histogram

from space.controller.placement import Need, place, used_memory_mib
from space.db.listen import Listener
from space.db.store import Row, Store
from space.db.store.workers import WorkerLoad
from space.settings import PoolSettings

log = logging.getLogger(__name__)

PASS_S = 0.5  # at most this long between passes; a sandbox change wakes the loop sooner

REFILL = Histogram(
    "space_pool_refill_seconds",
    "From a pool member's creation to it being ready to claim",
    ["template"],
    buckets=(0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30),
)
DROPPED = Metric(
    "space_pool_dropped_total",
    "Pool members deleted before a claim, by why",
    ["template", "why"],
)
TARGET = Gauge("space_pool_target", "Members each pool should have", ["template"])
LIVE = Gauge("space_pool_members", "Pool members ready or on their way", ["template"])


class Pools:
    def __init__(self, store: Store, settings: PoolSettings) -> None:
        self.store = store
        self.reserve_mib = settings.reserve_mib
        self.refill_concurrency = settings.refill_concurrency

    async def run(self, listener: Listener) -> None:
        wake = listener.subscribe()
        try:
            while True:
                wake.clear()
                try:
                    await self.tend()
                except Exception:
                    log.exception("warm pool pass failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), PASS_S)
                await asyncio.sleep(0.05)  # a burst of changes makes one pass, not many
        finally:
            listener.unsubscribe(wake)

    async def tend(self) -> None:
        """One pass: drop broken, misshapen, surplus and squeezed members; add missing ones."""
        templates = {r["id"]: r for r in await self.store.templates()}
        members = await self.store.pool_members()
        workers = await self.store.workers()
        load = await self.store.worker_load()
        squeezed = {
            w["id"] for w in workers
            if w["mem_available_mib"] is not None and w["mem_available_mib"] < self.reserve_mib
        }  # fmt: skip

        keep: dict[str, list[Row]] = {tid: [] for tid in templates}
        for m in members:
            tpl = templates.get(m["template"])
            if m["state"] == "error":
                await self._drop(m, "broken", f"broken: {m['reason']}")
            elif tpl is None or _shape(m) != _pool_shape(tpl):
                await self._drop(m, "reshaped", "the pool changed shape")
            else:
                keep[tpl["id"]].append(m)

        # Memory pressure: one member per squeezed worker per pass, the newest first.
        for worker_id in squeezed:
            on_it = [m for ms in keep.values() for m in ms if m["worker_id"] == worker_id]
            if on_it:
                victim = max(on_it, key=lambda m: m["created_at"])
                keep[victim["template"]].remove(victim)
                await self._drop(victim, "memory", f"worker {worker_id} is short of memory")

        for tid, tpl in templates.items():
            have = keep[tid]
            TARGET.labels(tid).set(tpl["pool_size"])
            surplus = len(have) - tpl["pool_size"]
            # Members still starting go first: they cost less to give up.
            for m in sorted(have, key=lambda m: (m["state"] == "running", m["created_at"]))[
                : max(surplus, 0)
            ]:
                have.remove(m)
                await self._drop(m, "surplus", "the pool shrank")
            starting = sum(1 for m in have if m["state"] != "running")
            room = max(0, self.refill_concurrency - starting)
            for _ in range(min(tpl["pool_size"] - len(have), room)):
                open_workers = [w for w in workers if w["id"] not in squeezed]
                need = Need(tpl["pool_vcpus"], tpl["pool_memory_mib"], tpl["pool_disk_mib"])
                if place(open_workers, load, need) is None:
                    break  # full: the pool stays short until room appears
                have.append(await self.store.add_pool_member(tpl))
            LIVE.labels(tid).set(len(have))

    async def evict_for(self, row: Row) -> str | None:
        """Delete pool members so that `row` fits somewhere: what is being done, for its
        events; None if that cannot help.

        Members on the worker closest to having room go first, so one eviction suffices when
        it can."""
        workers = {w["id"]: w for w in await self.store.workers() if w["state"] == "active"}
        if any(m["worker_id"] in workers for m in await self.store.pool_members(dropping=True)):
            return "warm-pool members are giving way"  # the load does not show it yet
        load = await self.store.worker_load()
        by_worker: dict[str, list[Row]] = {}
        for m in await self.store.pool_members():
            if m["worker_id"] in workers:
                by_worker.setdefault(m["worker_id"], []).append(m)
        best: tuple[int, list[Row]] | None = None
        for worker_id, ms in by_worker.items():
            w = workers[worker_id]
            here = load.get(worker_id, WorkerLoad())
            overhead = w["overhead_mib"]
            need_mem = (used_memory_mib(w, here) + overhead + row["memory_mib"]
                        - w["capacity_memory_mib"])  # fmt: skip
            need_cpu = here.vcpus + row["vcpus"] - w["capacity_vcpus"]
            victims: list[Row] = []
            for m in sorted(ms, key=lambda m: m["memory_mib"], reverse=True):
                if need_mem <= 0 and need_cpu <= 0:
                    break
                victims.append(m)
                need_mem -= m["memory_mib"] + overhead
                need_cpu -= m["vcpus"]
            if need_mem <= 0 and need_cpu <= 0 and (best is None or len(victims) < best[0]):
                best = (len(victims), victims)
        if best is None:
            return None
        for m in best[1]:
            await self._drop(m, "evicted", f"room for sandbox {row['id']}")
        template = best[1][0]["template"]
        return f"{len(best[1])} warm-pool member(s) of {template} evicted to make room"

    def refilled(self, member: Row) -> None:
        took = (datetime.now(UTC) - member["created_at"]).total_seconds()
        REFILL.labels(member["template"]).observe(took)

    async def _drop(self, member: Row, why: str, reason: str) -> None:
        if await self.store.drop_pool_members([member["id"]], reason):
            DROPPED.labels(member["template"], why).inc()
            log.info("pool member %s dropped: %s", member["id"], reason)


def _shape(row: Row) -> tuple[int, int, int]:
    return row["vcpus"], row["memory_mib"], row["disk_mib"]


def _pool_shape(tpl: Row) -> tuple[int, int, int]:
    return tpl["pool_vcpus"], tpl["pool_memory_mib"], tpl["pool_disk_mib"]

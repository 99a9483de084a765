"""Which worker gets a new sandbox: an active one with room, the least loaded first."""

from __future__ import annotations

from collections.abc import Sequence

from space.db.store import Row


def pick_worker(
    workers: Sequence[Row], load: dict[str, tuple[int, int]], vcpus: int, memory_mib: int
) -> str | None:
    best: tuple[float, str] | None = None
    for w in workers:
        if w["state"] != "active":
            continue
        used_cpu, used_mem = load.get(w["id"], (0, 0))
        cpu_cap, mem_cap = w["capacity_vcpus"], w["capacity_memory_mib"]
        if used_cpu + vcpus > cpu_cap or used_mem + memory_mib > mem_cap:
            continue
        score = max(used_mem / mem_cap, used_cpu / cpu_cap)
        if best is None or (score, w["id"]) < best:
            best = (score, w["id"])
    return best[1] if best else None

"""Which worker gets a new sandbox: an active, healthy one with room, the least loaded first.

Memory is counted as the worker measures it: what its VMMs really take (their proportional set
size, so pages the host merges across clones count once), plus the room it holds for VMs being
made or resumed, as of its last health probe; sandboxes placed there since count at their guest
RAM plus the VMM overhead the worker measured. A worker that was never measured is counted by
guest RAM. vCPUs count against the worker's (overcommitted) vCPUs; disk against what its pool
can still promise. Sandboxes that hold a VM or will need one again count (a suspended one holds
its resume's room); an `error` one holds none.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from space.db.store import Row
from space.db.store.workers import WorkerLoad

# A pull costs seconds per GiB; a worker that holds the template wins against one up to this
# much less loaded (a share of its memory or vCPUs), and loses beyond.
AFFINITY = 0.25


def holding(workers: Sequence[Row], template: str, record: Mapping[str, Any] | None) -> set[str]:
    """The workers that hold the build of `template` in use (their probes say so)."""
    digest = (record or {}).get("digest")
    return {w["id"] for w in workers if digest and (w["templates"] or {}).get(template) == digest}


@dataclass(frozen=True)
class Need:
    vcpus: int
    memory_mib: int
    disk_mib: int = 0


Load = Mapping[str, WorkerLoad]


def used_memory_mib(w: Row, load: WorkerLoad, members_give_way: bool = False) -> int:
    """MiB in use on worker `w`: measured, plus what was placed there since."""
    overhead: int = w["overhead_mib"]
    measured: int | None = w["used_memory_mib"]
    if measured is None:
        used = load.memory_mib + load.count * overhead
    else:
        used = measured + load.fresh_memory_mib + load.fresh_count * overhead
    if members_give_way and load.pool_count:
        given = load.pool_memory_mib + load.pool_count * overhead
        settled = load.count - load.fresh_count
        if measured is not None and settled > 0:
            # A member gives back what it takes, which a measurement knows only on average.
            given = min(given, load.pool_count * (measured // settled))
        used -= given
    return max(used, 0)


def shortage(w: Row, load: Load, need: Need, members_give_way: bool = False) -> str | None:
    """Why `need` does not fit on worker `w` now; None if it does."""
    if w["state"] != "active":
        return f"worker {w['id']} is {w['state']}"
    if w["draining"]:
        return f"worker {w['id']} is being drained"
    if w["problem"]:
        return f"worker {w['id']}: {w['problem']}"
    here = load.get(w["id"], WorkerLoad())
    cpu = here.vcpus - (here.pool_vcpus if members_give_way else 0)
    if cpu + need.vcpus > w["capacity_vcpus"]:
        return f"worker {w['id']}: {cpu} of {w['capacity_vcpus']} vCPUs in use"
    used_mem = used_memory_mib(w, here, members_give_way)
    if used_mem + need.memory_mib + w["overhead_mib"] > w["capacity_memory_mib"]:
        return f"worker {w['id']}: {used_mem} of {w['capacity_memory_mib']} MiB in use"
    if w["capacity_disk_mib"] and w["used_disk_mib"] + need.disk_mib > w["capacity_disk_mib"]:
        return (
            f"worker {w['id']}: its disk pool can take {w['capacity_disk_mib']} MiB more, "
            f"{w['used_disk_mib']} MiB of it promised"
        )
    return None


def pick_worker(
    workers: Sequence[Row], load: Load, need: Need, members_give_way: bool = False,
    prefer: Collection[str] = (),
) -> str | None:  # fmt: skip
    """The least loaded worker `need` fits on; a worker in `prefer` (one that holds the
    template already) counts as AFFINITY less loaded than it is."""
    best: tuple[float, str] | None = None
    for w in workers:
        if shortage(w, load, need, members_give_way) is not None:
            continue
        here = load.get(w["id"], WorkerLoad())
        used_mem = used_memory_mib(w, here, members_give_way)
        score = max(used_mem / w["capacity_memory_mib"], here.vcpus / w["capacity_vcpus"])
        if w["id"] in prefer:
            score -= AFFINITY
        if best is None or (score, w["id"]) < best:
            best = (score, w["id"])
    return best[1] if best else None


def place(workers: Sequence[Row], load: MutableMapping[str, WorkerLoad], need: Need) -> str | None:
    """pick_worker, and count `need` in `load` where it went (for several placements at once)."""
    worker_id = pick_worker(workers, load, need)
    if worker_id is not None:
        here = load.get(worker_id, WorkerLoad())
        load[worker_id] = replace(
            here,
            vcpus=here.vcpus + need.vcpus,
            memory_mib=here.memory_mib + need.memory_mib,
            disk_mib=here.disk_mib + need.disk_mib,
            count=here.count + 1,
            fresh_memory_mib=here.fresh_memory_mib + need.memory_mib,
            fresh_count=here.fresh_count + 1,
        )
    return worker_id


def why_not(workers: Sequence[Row], load: Load, need: Need, members_give_way: bool = False) -> str:
    """What keeps `need` off every worker, for a refusal that says so."""
    reasons = [r for w in workers if (r := shortage(w, load, need, members_give_way))]
    return "; ".join(reasons) or "no worker is registered"

"""The hosts of the platform, for admins: what each admits, what admission counts in use (as
its worker measured it), what is placed there, and whether it takes work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from fastapi import APIRouter
from pydantic import BaseModel, Field

from space.api.deps import Caller, Svc, require_admin
from space.api.errors import APIError
from space.controller.placement import used_memory_mib
from space.db.store import Row
from space.db.store.workers import WorkerLoad

router = APIRouter(prefix="/v1/workers", tags=["workers"])


class Shares(BaseModel):
    disk_mib_s: int = Field(0, description="MiB/s of disk I/O, all its drives together; 0: none")
    disk_iops: int = Field(0, description="disk operations a second; 0: no limit")
    net_mbit: int = Field(0, description="Mbit/s each way through its network; 0: no limit")


class WorkerInfo(BaseModel):
    id: str
    state: str = Field(description="active, or lost (it stopped answering)")
    draining: bool = Field(description="being drained: it takes nothing new, its sandboxes move")
    registry: bool = Field(description="it pushes to the registry: its sandboxes can move")
    templates: list[str] = Field(description="the templates it holds")
    problem: str | None = Field(description="why it takes no work now, if it does not")
    sandboxes: int = Field(description="sandboxes placed there that hold room (pool members too)")
    pool_members: int
    vcpus: int = Field(description="vCPUs it admits (overcommitted per host core)")
    vcpus_used: int
    memory_mib: int = Field(description="memory it admits, after its reserve")
    memory_used_mib: int = Field(
        description="in use as admission counts it: measured (VMM PSS) at its last probe, "
        "plus what was placed there since"
    )
    guest_memory_mib: int = Field(description="the guest RAM its sandboxes were given, in all")
    overhead_mib: int = Field(description="what a VMM takes beyond its guest's RAM, measured")
    measured_at: datetime | None
    disk_mib: int = Field(description="what its pool can still promise to sparse disks")
    disk_used_mib: int
    shares: Shares = Field(description="what one sandbox may take of its disk and network")
    version: str = Field(description="its release")


class WorkerList(BaseModel):
    items: list[WorkerInfo]


@router.get("", response_model=WorkerList)
async def list_workers(svc: Svc, caller: Caller) -> WorkerList:
    require_admin(caller, "list workers")
    return WorkerList(items=describe(await svc.store.workers(), await svc.store.worker_load()))


@router.post("/{worker_id}/drain", response_model=WorkerInfo)
async def drain(svc: Svc, caller: Caller, worker_id: str) -> WorkerInfo:
    """Keep new work away from the worker and move its sandboxes off it (docs/api.md)."""
    return await _set_draining(svc, caller, worker_id, True)


@router.delete("/{worker_id}/drain", response_model=WorkerInfo)
async def undrain(svc: Svc, caller: Caller, worker_id: str) -> WorkerInfo:
    """The worker takes work again."""
    return await _set_draining(svc, caller, worker_id, False)


async def _set_draining(svc: Svc, caller: Caller, worker_id: str, draining: bool) -> WorkerInfo:
    require_admin(caller, "drain workers")
    if await svc.store.set_draining(worker_id, draining) is None:
        raise APIError(404, f"no worker {worker_id}")
    (info,) = [i for i in describe(await svc.store.workers(), await svc.store.worker_load())
               if i.id == worker_id]  # fmt: skip
    return info


def describe(workers: Sequence[Row], load: Mapping[str, WorkerLoad]) -> list[WorkerInfo]:
    """What the API and `space admin workers` say of each worker."""
    items = []
    for w in workers:
        here = load.get(w["id"], WorkerLoad())
        items.append(
            WorkerInfo(
                id=w["id"],
                state=w["state"],
                draining=w["draining"],
                registry=w["registry"],
                templates=sorted(w["templates"] or {}),
                problem=w["problem"],
                sandboxes=here.count,
                pool_members=here.pool_count,
                vcpus=w["capacity_vcpus"],
                vcpus_used=here.vcpus,
                memory_mib=w["capacity_memory_mib"],
                memory_used_mib=used_memory_mib(w, here),
                guest_memory_mib=here.memory_mib,
                overhead_mib=w["overhead_mib"],
                measured_at=w["measured_at"],
                disk_mib=w["capacity_disk_mib"],
                disk_used_mib=w["used_disk_mib"],
                shares=Shares(**w["shares"]),
                version=w["version"],
            )
        )
    return sorted(items, key=lambda i: i.id)

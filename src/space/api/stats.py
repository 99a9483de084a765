"""What a running sandbox uses now: CPU, memory, disk and network, measured by its worker on the
host (the VMM process, the disk on the pool, the tap), never reported by the guest."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from space.api.deps import Caller, Svc

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])


class SandboxStats(BaseModel):
    id: str
    state: str
    at: float = Field(description="when it was measured (unix time, seconds)")
    vcpus: int
    memory_mib: int = Field(description="the guest RAM it was given")
    cpu_seconds: float = Field(
        description="CPU time of its VMM process (user + system) since the VMM started; "
        "the rate between two readings is its CPU use"
    )
    memory_bytes: int = Field(
        description="proportional set size of its VMM process: the guest RAM it has touched "
        "plus the VMM's own"
    )
    disk_bytes: int = Field(
        description="bytes its root disk has allocated on the worker's pool (extents shared "
        "with its template included)"
    )
    net_rx_bytes: int | None = Field(description="bytes its NIC received; null: it has none")
    net_tx_bytes: int | None = Field(
        description="bytes its NIC sent, whether its egress policy let them out or not"
    )


@router.get("/{sandbox_id}/stats", response_model=SandboxStats)
async def sandbox_stats(sandbox_id: str, svc: Svc, caller: Caller) -> SandboxStats:
    """409 unless it is running."""
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    stats = await svc.workers.stats(await svc.running_on(row), sandbox_id)
    return SandboxStats.model_validate(stats.model_dump())

"""What the caller's tenant may hold at once, and what it holds now."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from space.api.deps import Caller, Svc

router = APIRouter(prefix="/v1/quotas", tags=["quotas"])


class QuotaFigures(BaseModel):
    sandboxes: int = Field(description="not deleted: running, paused, suspended, pending, error")
    vcpus: int
    memory_mib: int
    disk_mib: int = Field(description="sandbox disks at their full size, sparse or not")
    volumes: int
    volume_mib: int
    checkpoints: int = Field(description="of sandboxes not deleted")
    checkpoint_mib: int = Field(description="their bytes on the workers' pools, rounded up")


class QuotaReport(BaseModel):
    quotas: QuotaFigures = Field(description="the most the tenant may hold at once")
    used: QuotaFigures = Field(description="what it holds now")


@router.get("", response_model=QuotaReport)
async def quotas(svc: Svc, caller: Caller) -> QuotaReport:
    """A create that would go past a quota is answered 429, naming it."""
    limits, used = await svc.store.quotas_of(caller.id, svc.settings.quotas)
    return QuotaReport(
        quotas=QuotaFigures(**limits.as_dict()), used=QuotaFigures.model_validate(used)
    )

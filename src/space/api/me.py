"""Who the caller is: the tenant its key belongs to, and whether it is an admin key."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from space.api.deps import Caller

router = APIRouter(prefix="/v1/me", tags=["keys"])


class Identity(BaseModel):
    tenant_id: str
    tenant_name: str
    admin: bool = Field(
        description="an operator's key: builds templates, sizes warm pools, manages tenants"
    )
    key_id: str | None = Field(description="the key's public part, as tenants' key lists name it")


@router.get("", response_model=Identity)
async def me(caller: Caller) -> Identity:
    """401 for a key that is not valid (a way to check one)."""
    return Identity(
        tenant_id=caller.id, tenant_name=caller.name, admin=caller.admin, key_id=caller.key_id
    )

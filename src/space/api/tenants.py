"""Tenants and their API keys, for admin keys: the operators of a deployment manage every
tenant, as `space admin` does from the database. A key is shown once, in the answer that made
it (only its hash is stored); listings never carry a key or its hash."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, Field

from space.api.deps import Caller, Svc, require_admin
from space.api.errors import APIError
from space.db.store import Row, Tenant, key_id_of

router = APIRouter(prefix="/v1/tenants", tags=["tenants"])
log = logging.getLogger(__name__)


async def admin(caller: Caller) -> Tenant:
    require_admin(caller, "manage tenants and keys")
    return caller


Admin = Annotated[Tenant, Depends(admin)]


class TenantInfo(BaseModel):
    id: str
    name: str
    created_at: datetime
    sandboxes: int = Field(description="sandboxes not deleted, whatever their state")
    vcpus: int = Field(description="their vCPUs")
    memory_mib: int = Field(description="their memory")
    keys: int = Field(description="active API keys")


class TenantList(BaseModel):
    items: list[TenantInfo]


class NewTenant(BaseModel):
    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]*$",
        max_length=100,
        description="unique; letters, digits and ._@- (a letter or digit first)",
    )


class KeyInfo(BaseModel):
    id: str = Field(description="the key's public part, the 12 characters after sk_space_")
    name: str
    admin: bool = Field(description="an operator's key: manages every tenant, templates, pools")
    created_at: datetime


class KeyList(BaseModel):
    items: list[KeyInfo]


class NewKey(BaseModel):
    name: str = Field(default="", max_length=100, pattern=r"^[^\x00-\x1f\x7f]*$",
                      description="a label for the key")  # fmt: skip
    admin: bool = False


class CreatedKey(KeyInfo):
    key: str = Field(description="the key itself: shown this once, only its hash is kept")


async def _tenant(svc: Svc, tenant_id: str) -> Row:
    found = await svc.store.tenants(tenant_id)
    if not found:
        raise APIError(404, f"no tenant {tenant_id!r}")
    return found[0]


@router.get("", response_model=TenantList)
async def list_tenants(svc: Svc, _: Admin) -> TenantList:
    """Every tenant (the warm pools' own excepted), with what it holds now."""
    return TenantList(items=[TenantInfo(**r) for r in await svc.store.tenants()])


@router.post("", response_model=TenantInfo, status_code=201)
async def create_tenant(body: NewTenant, svc: Svc, caller: Admin) -> TenantInfo:
    """409 if a tenant has that name already."""
    made = await svc.store.create_tenant(body.name, exist_ok=False)
    log.info("tenant %s (%s) created by key %s", made.id, made.name, caller.key_id)
    return TenantInfo(**await _tenant(svc, made.id))


@router.get("/{tenant_id}", response_model=TenantInfo)
async def get_tenant(tenant_id: str, svc: Svc, _: Admin) -> TenantInfo:
    return TenantInfo(**await _tenant(svc, tenant_id))


@router.get("/{tenant_id}/keys", response_model=KeyList)
async def list_keys(tenant_id: str, svc: Svc, _: Admin) -> KeyList:
    """The tenant's active keys: never a key or its hash."""
    await _tenant(svc, tenant_id)
    return KeyList(items=[KeyInfo(**r) for r in await svc.store.api_keys(tenant_id)])


@router.post("/{tenant_id}/keys", response_model=CreatedKey, status_code=201)
async def create_key(
    tenant_id: str, body: NewKey, svc: Svc, caller: Admin, response: Response
) -> CreatedKey:
    """The answer is the only place the key is ever shown: it is not kept, nor cached."""
    await _tenant(svc, tenant_id)
    key = await svc.store.create_api_key(tenant_id, body.name, admin=body.admin)
    row = (await svc.store.api_keys(tenant_id, key_id_of(key)))[0]
    log.info("key %s (admin=%s) of tenant %s created by key %s",
             row["id"], body.admin, tenant_id, caller.key_id)  # fmt: skip
    response.headers["Cache-Control"] = "no-store"
    return CreatedKey(**row, key=key)


@router.delete("/{tenant_id}/keys/{key_id}", status_code=204)
async def revoke_key(tenant_id: str, key_id: str, svc: Svc, caller: Admin) -> Response:
    """At once: the key's next call is 401 (the key making this call may be the one)."""
    await _tenant(svc, tenant_id)
    if not await svc.store.revoke_api_key(key_id, tenant_id):
        raise APIError(404, f"no active key {key_id!r} of tenant {tenant_id!r}")
    log.info("key %s of tenant %s revoked by key %s", key_id, tenant_id, caller.key_id)
    return Response(status_code=204)

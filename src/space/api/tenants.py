"""Tenants and their API keys, for admin keys: the operators of a deployment manage every
tenant, as `space admin` does from the database. A key is shown once, in the answer that made
it (only its hash is stored); listings never carry a key or its hash."""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, Field

from space import logs
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


class TenantChange(NewTenant):
    """A tenant's new name."""


class TenantDeletionInfo(BaseModel):
    """What deleting the tenant does (or did): every sandbox of it deleted (stopped, its disk
    and snapshots removed), its volumes deleted once no sandbox has them, its keys revoked, its
    secrets and webhooks removed at once. Its usage and audit entries stay."""

    id: str
    name: str
    sandboxes: list[str] = Field(description="its sandboxes not deleted: each is deleted")
    volumes: list[str] = Field(description="its volumes: each is deleted, data and all")
    keys: int = Field(description="active keys: revoked at once")
    secrets: int
    webhooks: int


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


@router.patch("/{tenant_id}", response_model=TenantInfo)
async def rename_tenant(tenant_id: str, body: TenantChange, svc: Svc, caller: Admin) -> TenantInfo:
    """A new name (409 if another tenant has it); its keys, sandboxes and usage stay as they are."""
    await svc.store.rename_tenant(tenant_id, body.name)
    log.info("tenant %s renamed %s by key %s", tenant_id, body.name, caller.key_id)
    return TenantInfo(**await _tenant(svc, tenant_id))


@router.get("/{tenant_id}/deletion", response_model=TenantDeletionInfo)
async def deletion(tenant_id: str, svc: Svc, _: Admin) -> TenantDeletionInfo:
    """What `DELETE /v1/tenants/{id}` would do now."""
    row = await _tenant(svc, tenant_id)
    held = await svc.store.tenant_deletion(tenant_id)
    return TenantDeletionInfo(id=row["id"], name=row["name"], **dataclasses.asdict(held))


@router.delete("/{tenant_id}", response_model=TenantDeletionInfo)
async def delete_tenant(
    tenant_id: str,
    svc: Svc,
    caller: Admin,
    confirm: Annotated[str, Query(max_length=100, description="the tenant's name")] = "",
) -> TenantDeletionInfo:
    """Deletes the tenant and everything it holds (`GET …/deletion` says what, beforehand);
    `confirm` must be its name. Refused for the caller's own tenant."""
    row = await _tenant(svc, tenant_id)
    if tenant_id == caller.id:
        raise APIError(409, "a key cannot delete its own tenant: use another tenant's admin key")
    if confirm != row["name"]:
        held = await svc.store.tenant_deletion(tenant_id)
        raise APIError(400, f"deleting tenant {row['name']!r} deletes its "
                       f"{len(held.sandboxes)} sandbox(es) and {len(held.volumes)} volume(s) "
                       f"and revokes its {held.keys} key(s): pass confirm={row['name']} "
                       "to do it")  # fmt: skip
    held = await svc.store.delete_tenant(tenant_id, logs.request_id.get())
    log.warning("tenant %s (%s) deleted by key %s: %d sandbox(es), %d volume(s)", tenant_id,
                row["name"], caller.key_id, len(held.sandboxes), len(held.volumes))  # fmt: skip
    return TenantDeletionInfo(id=tenant_id, name=row["name"], **dataclasses.asdict(held))


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

"""Tenants and their API keys (only a key's SHA-256 is stored)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import (
    POOL_NAME,
    POOL_TENANT,
    Queries,
    Refused,
    Row,
    Tenant,
    event,
    new_id,
    notify,
)

KEY_PREFIX = "sk_space_"


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def key_id_of(key: str) -> str:
    """A key's public part: its id, the characters between the prefix and the secret."""
    return key[len(KEY_PREFIX) :].split("_", 1)[0]


@dataclass(frozen=True)
class TenantDeletion:
    """What deleting a tenant does: its sandboxes and volumes are deleted (by the controller,
    as a delete each), its keys revoked, its secrets and webhooks removed at once."""

    sandboxes: list[str]
    volumes: list[str]
    keys: int
    secrets: int
    webhooks: int


class TenantQueries(Queries):
    async def create_tenant(self, name: str, exist_ok: bool = True) -> Tenant:
        """The tenant of that name, made if there is none (with `exist_ok=False`, 409 if
        there is one)."""
        if name == POOL_NAME:
            raise ValueError(f"{name!r} is reserved for the warm pools")
        tenants = t.tenants.c
        async with self.engine.begin() as c:
            # ON CONFLICT: two creates of one name at once make one tenant, and neither fails.
            made = await c.scalar(
                pg_insert(t.tenants)
                .values(id=new_id("tn"), name=name)
                .on_conflict_do_nothing(index_elements=[tenants.name])
                .returning(tenants.id)
            )
            if made is not None:
                return Tenant(made, name)
            if not exist_ok:
                raise Refused(409, f"there is a tenant named {name!r} already")
            query = sa.select(tenants.id).where(tenants.name == name)
            return Tenant((await c.execute(query)).scalar_one(), name)

    async def tenants(self, tenant_id: str | None = None) -> list[Row]:
        """Every tenant (or the one asked for) but the warm pools', oldest first, with what it
        holds now (sandboxes not deleted, their vCPUs and memory) and its active keys."""
        s, k, tn = t.sandboxes.c, t.api_keys.c, t.tenants.c
        held = (
            sa.select(
                s.tenant_id,
                sa.func.count().label("sandboxes"),
                sa.func.sum(s.vcpus).label("vcpus"),
                sa.func.sum(s.memory_mib).label("memory_mib"),
            )
            .where(s.state != "deleted")
            .group_by(s.tenant_id)
            .subquery()
        )
        keys = (
            sa.select(k.tenant_id, sa.func.count().label("keys"))
            .where(k.revoked_at.is_(None))
            .group_by(k.tenant_id)
            .subquery()
        )
        query = (
            sa.select(
                tn.id,
                tn.name,
                tn.created_at,
                *(
                    sa.func.coalesce(col, 0).label(col.name)
                    for col in (held.c.sandboxes, held.c.vcpus, held.c.memory_mib, keys.c["keys"])
                ),
            )
            .outerjoin(held, held.c.tenant_id == tn.id)
            .outerjoin(keys, keys.c.tenant_id == tn.id)
            .where(tn.id != POOL_TENANT, tn.deleted_at.is_(None))
            .order_by(tn.created_at, tn.name)
        )
        if tenant_id is not None:
            query = query.where(tn.id == tenant_id)
        async with self.engine.connect() as c:
            return list((await c.execute(query)).mappings())

    async def rename_tenant(self, tenant_id: str, name: str) -> None:
        """Refused: 404 for no such tenant, 409 for a name taken."""
        tn = t.tenants.c
        q = (t.tenants.update().where(tn.id == tenant_id, tn.id != POOL_TENANT,
                                      tn.deleted_at.is_(None)).values(name=name))  # fmt: skip
        if name == POOL_NAME:
            raise Refused(409, f"{name!r} is reserved for the warm pools")
        try:
            async with self.engine.begin() as c:
                if (await c.execute(q)).rowcount != 1:
                    raise Refused(404, f"no tenant {tenant_id!r}")
        except sa.exc.IntegrityError:
            raise Refused(409, f"there is a tenant named {name!r} already") from None

    async def tenant_deletion(self, tenant_id: str) -> TenantDeletion:
        """What deleting the tenant would do now."""
        async with self.engine.connect() as c:
            return await _holdings(c, tenant_id)

    async def delete_tenant(self, tenant_id: str, request_id: str | None = None) -> TenantDeletion:
        """At once, in one transaction: its keys revoked, its secrets and webhooks removed,
        every sandbox of it asked to be deleted, its volumes to follow once no sandbox has them,
        and its name freed. Refused (404) for no such tenant."""
        tn, s, k, v = t.tenants.c, t.sandboxes.c, t.api_keys.c, t.volumes.c
        async with self.engine.begin() as c:
            gone = await c.execute(
                t.tenants.update()
                .where(tn.id == tenant_id, tn.id != POOL_TENANT, tn.deleted_at.is_(None))
                # A name no tenant can be given: the old one is free, and this one never clashes.
                .values(deleted_at=sa.func.now(), name=tn.id + " (deleted)")
            )
            if gone.rowcount != 1:
                raise Refused(404, f"no tenant {tenant_id!r}")
            held = await _holdings(c, tenant_id)
            await c.execute(
                t.api_keys.update().where(k.tenant_id == tenant_id, k.revoked_at.is_(None))
                .values(revoked_at=sa.func.now())
            )  # fmt: skip
            await c.execute(t.secrets.delete().where(t.secrets.c.tenant_id == tenant_id))
            await c.execute(t.webhooks.delete().where(t.webhooks.c.tenant_id == tenant_id))
            rows = (await c.execute(
                t.sandboxes.update()
                .where(s.tenant_id == tenant_id, s.state != "deleted", s.desired_state != "deleted")
                .values(desired_state="deleted", request_id=request_id, updated_at=sa.func.now())
                .returning(*t.sandboxes.c)
            )).mappings().all()  # fmt: skip
            for row in rows:
                await event(c, row, "requested", row["state"], "deleted", "its tenant was deleted")
                await notify(c, row["id"])
            # Through `deleting` (deleted once no sandbox has it): one never placed yet may be
            # about to be, by a sandbox of the tenant still on its way.
            await c.execute(
                t.volumes.update().where(v.tenant_id == tenant_id, v.state == "available")
                .values(state="deleting")
            )  # fmt: skip
            await _drop_templates(c, tenant_id)
        return held

    async def tenant_named(self, name: str) -> Tenant | None:
        async with self.engine.connect() as c:
            row = (await c.execute(sa.select(t.tenants).where(t.tenants.c.name == name))).first()
        return None if row is None else Tenant(row.id, row.name)

    async def create_api_key(self, tenant_id: str, name: str = "", admin: bool = False) -> str:
        """A new key; only its hash is stored, so this is the one time it can be seen. (One made
        for a tenant deleted meanwhile is refused like every key of it: `authenticate`.)"""
        if tenant_id == POOL_TENANT:
            raise ValueError("the warm pools' tenant has no keys")
        key_id = secrets.token_hex(6)
        secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
        key = f"{KEY_PREFIX}{key_id}_{secret}"
        async with self.engine.begin() as c:
            await c.execute(
                t.api_keys.insert().values(
                    id=key_id,
                    tenant_id=tenant_id,
                    secret_sha256=_sha256(key),
                    name=name,
                    admin=admin,
                )
            )
        return key

    async def api_keys(self, tenant_id: str, key_id: str | None = None) -> list[Row]:
        """A tenant's active keys (or the one asked for), oldest first: never their hash."""
        k = t.api_keys.c
        query = (
            sa.select(k.id, k.name, k.admin, k.created_at)
            .where(k.tenant_id == tenant_id, k.revoked_at.is_(None))
            .order_by(k.created_at, k.id)
        )
        if key_id is not None:
            query = query.where(k.id == key_id)
        async with self.engine.connect() as c:
            return list((await c.execute(query)).mappings())

    async def revoke_api_key(self, key_id: str, tenant_id: str | None = None) -> bool:
        """False if there is no such active key (of that tenant, when one is named)."""
        k = t.api_keys.c
        query = t.api_keys.update().where(k.id == key_id, k.revoked_at.is_(None))
        if tenant_id is not None:
            query = query.where(k.tenant_id == tenant_id)
        async with self.engine.begin() as c:
            res = await c.execute(query.values(revoked_at=sa.func.now()))
            return res.rowcount == 1

    async def authenticate(self, key: str) -> Tenant | None:
        if not key.startswith(KEY_PREFIX) or len(key) > 200:
            return None
        row = await self._active_key(key_id_of(key))
        if row is None or not hmac.compare_digest(bytes(row.secret_sha256), _sha256(key)):
            return None
        return Tenant(row.id, row.name, bool(row.admin), row.key_id)

    async def tenant_of_key(self, key_id: str) -> Tenant | None:
        """The tenant of a key that is still active, for what the key signed (a link)."""
        row = await self._active_key(key_id)
        return None if row is None else Tenant(row.id, row.name, bool(row.admin), row.key_id)

    async def active_key_ids(self, tenant_id: str, limit: int = 1000) -> list[str]:
        """The ids of a tenant's keys that are not revoked (none once it is deleted)."""
        k = t.api_keys.c
        q = (
            sa.select(k.id)
            .join(t.tenants, t.tenants.c.id == k.tenant_id)
            .where(k.tenant_id == tenant_id, k.revoked_at.is_(None),
                   t.tenants.c.deleted_at.is_(None))
            .order_by(k.id)
            .limit(limit)
        )  # fmt: skip
        async with self.engine.connect() as c:
            return list((await c.execute(q)).scalars())

    async def _active_key(self, key_id: str) -> sa.Row[Any, Any, Any, Any, Any] | None:
        async with self.engine.connect() as c:
            return (
                await c.execute(
                    sa.select(
                        t.api_keys.c.id.label("key_id"),
                        t.api_keys.c.secret_sha256,
                        t.api_keys.c.admin,
                        t.tenants.c.id,
                        t.tenants.c.name,
                    )
                    .join(t.tenants, t.tenants.c.id == t.api_keys.c.tenant_id)
                    .where(
                        t.api_keys.c.id == key_id,
                        t.api_keys.c.revoked_at.is_(None),
                        t.tenants.c.deleted_at.is_(None),
                    )
                )
            ).first()


async def _drop_templates(c: AsyncConnection, tenant_id: str) -> None:
    """The tenant's own templates (its snapshots, which hold its sandboxes' memory): builds not
    started are dropped, templates never made forgotten, the rest removed from their workers
    by the controller once no sandbox has them."""
    tp, b = t.templates.c, t.template_builds.c
    own = sa.select(tp.id).where(tp.tenant_id == tenant_id).scalar_subquery()
    await c.execute(t.template_builds.delete().where(b.template_id.in_(own)))
    await c.execute(t.templates.delete().where(tp.tenant_id == tenant_id, tp.worker_id.is_(None)))
    await c.execute(
        t.templates.update().where(tp.tenant_id == tenant_id, tp.state != "deleting")
        .values(state="deleting", pool_size=0)
    )  # fmt: skip


async def _holdings(c: AsyncConnection, tenant_id: str) -> TenantDeletion:
    s, v, k = t.sandboxes.c, t.volumes.c, t.api_keys.c

    async def count(table: sa.Table, *where: Any) -> int:
        return int(await c.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0)

    sandboxes = await c.execute(
        sa.select(s.id).where(s.tenant_id == tenant_id, s.state != "deleted").order_by(s.id)
    )
    volumes = await c.execute(
        sa.select(v.id).where(v.tenant_id == tenant_id, v.state == "available").order_by(v.id)
    )
    return TenantDeletion(
        sandboxes=list(sandboxes.scalars()),
        volumes=list(volumes.scalars()),
        keys=await count(t.api_keys, k.tenant_id == tenant_id, k.revoked_at.is_(None)),
        secrets=await count(t.secrets, t.secrets.c.tenant_id == tenant_id),
        webhooks=await count(t.webhooks, t.webhooks.c.tenant_id == tenant_id),
    )

"""Quota checks inside the transaction that adds a sandbox or a volume (see `space.quotas`):
the tenant's row is locked first, so concurrent creates of one tenant are counted one by one."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from space import quotas as q
from space.db import tables as t
from space.db.store.base import Queries, Refused

MIB = 1 << 20


async def sandbox_usage(c: AsyncConnection, tenant_id: str) -> dict[str, int]:
    s = t.sandboxes.c
    row = (
        await c.execute(
            sa.select(
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(s.vcpus), 0),
                sa.func.coalesce(sa.func.sum(s.memory_mib), 0),
                sa.func.coalesce(sa.func.sum(s.disk_mib), 0),
            ).where(s.tenant_id == tenant_id, s.state != "deleted")
        )
    ).one()
    return dict(zip(("sandboxes", "vcpus", "memory_mib", "disk_mib"), map(int, row), strict=True))


async def volume_usage(c: AsyncConnection, tenant_id: str) -> dict[str, int]:
    v = t.volumes.c
    row = (
        await c.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(v.size_mib), 0)).where(
                v.tenant_id == tenant_id, v.state != "deleted"
            )
        )
    ).one()
    return {"volumes": int(row[0]), "volume_mib": int(row[1])}


async def checkpoint_usage(c: AsyncConnection, tenant_id: str) -> dict[str, int]:
    k, s = t.checkpoints.c, t.sandboxes.c
    # Its real size once known; its sandbox's memory while it is being taken.
    size = sa.case((k.state == "creating", s.memory_mib * sa.literal(MIB)), else_=k.size_bytes)
    row = (
        await c.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(size), 0))
            .select_from(t.checkpoints.join(t.sandboxes, s.id == k.sandbox_id))
            .where(k.tenant_id == tenant_id, s.state != "deleted")
        )
    ).one()
    tp = t.templates.c
    # A snapshot (a template of the tenant's own) is a checkpoint kept: it counts as one.
    held = (
        await c.execute(
            sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(tp.held_bytes), 0)).where(
                tp.tenant_id == tenant_id, tp.state != "deleting", tp.record.is_not(None)
            )
        )
    ).one()
    count, total = int(row[0]) + int(held[0]), int(row[1]) + int(held[1])
    return {"checkpoints": count, "checkpoint_mib": -(-total // MIB)}


async def lock_for(
    c: AsyncConnection, tenant_id: str, defaults: q.Quotas | None
) -> q.Quotas | None:
    """Lock the tenant's row (before anything is added) and return its quotas. Refused (404)
    for a tenant deleted meanwhile: a call its key made just before is not let add to it."""
    tenants = t.tenants.c
    query = (sa.select(tenants.quotas, tenants.deleted_at).where(tenants.id == tenant_id)
             .with_for_update())  # fmt: skip
    row = (await c.execute(query)).first()
    if row is not None and row.deleted_at is not None:
        raise Refused(404, f"tenant {tenant_id} was deleted")
    if defaults is None:
        return None
    return defaults.with_overrides(row.quotas if row is not None else {})


async def enforce_sandboxes(c: AsyncConnection, tenant_id: str, quotas: q.Quotas | None) -> None:
    """After the insert, in its transaction: 429 (rolling it back) if the tenant is now over."""
    if quotas is not None and (why := q.over(quotas, await sandbox_usage(c, tenant_id))):
        raise Refused(429, why)


async def enforce_volumes(c: AsyncConnection, tenant_id: str, quotas: q.Quotas | None) -> None:
    if quotas is not None and (why := q.over(quotas, await volume_usage(c, tenant_id))):
        raise Refused(429, why)


class QuotaQueries(Queries):
    async def quotas_of(
        self, tenant_id: str, defaults: q.Quotas
    ) -> tuple[q.Quotas, dict[str, int]]:
        """A tenant's quotas and what it uses now."""
        overrides = await self.quota_overrides(tenant_id)
        async with self.engine.connect() as c:
            used = {**await sandbox_usage(c, tenant_id), **await volume_usage(c, tenant_id),
                    **await checkpoint_usage(c, tenant_id)}  # fmt: skip
        return defaults.with_overrides(overrides), used

    async def quota_overrides(self, tenant_id: str) -> dict[str, int]:
        async with self.engine.connect() as c:
            row = (
                await c.execute(sa.select(t.tenants.c.quotas).where(t.tenants.c.id == tenant_id))
            ).first()
        return dict(row.quotas) if row is not None else {}

    async def set_quotas(self, tenant_id: str, overrides: dict[str, Any]) -> dict[str, int]:
        """Replace a tenant's overrides (checked; `{}` for the defaults); its new overrides."""
        clean = q.validate_overrides(overrides)
        async with self.engine.begin() as c:
            res = await c.execute(
                t.tenants.update().where(t.tenants.c.id == tenant_id).values(quotas=clean)
            )
        if res.rowcount != 1:
            raise Refused(404, f"no tenant {tenant_id}")
        return clean

"""Warm-pool members: sandbox rows of the pool tenant, added, dropped and claimed."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import POOL_TENANT, Queries, Row, event, new_id, notify
from space.db.store.leases import worker_and_epoch
from space.db.store.quotas import enforce_sandboxes, lock_for
from space.quotas import Quotas


class PoolQueries(Queries):
    async def pool_members(self, dropping: bool = False) -> list[Row]:
        """Pool members not deleted yet, oldest first: those that stay, or (`dropping`) those
        being deleted."""
        s = t.sandboxes.c
        wanted = s.desired_state == "deleted" if dropping else s.desired_state != "deleted"
        q = (
            sa.select(t.sandboxes)
            .where(s.pool, s.state != "deleted", wanted)
            .order_by(s.created_at)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def add_pool_member(self, template: Row) -> Row:
        """A new pool member of the template's pool shape; the reconciler starts it."""
        values = {
            "id": new_id("sb"),
            "tenant_id": POOL_TENANT,
            "template": template["id"],
            "vcpus": template["pool_vcpus"],
            "memory_mib": template["pool_memory_mib"],
            "disk_mib": template["pool_disk_mib"],
            "timeout_s": 300,
            "timeout_action": "delete",
            "state": "pending",
            "desired_state": "running",
            "pool": True,
        }
        async with self.engine.begin() as c:
            row = (
                (await c.execute(t.sandboxes.insert().values(**values).returning(*t.sandboxes.c)))
                .mappings()
                .one()
            )
            await event(c, row, "created", None, "pending", "warm pool")
            await notify(c, row["id"])
            return row

    async def drop_pool_members(self, ids: Sequence[str], reason: str) -> int:
        """Ask for these pool members to be deleted (those still unclaimed)."""
        async with self.engine.begin() as c:
            return await drop_members(c, [t.sandboxes.c.id.in_(ids)], reason)

    # --- claims: a record, the worker's call, a confirmation ---------------------------------
    #
    # 1. `claim_member` marks the oldest ready member of the shape `claiming` with a token of
    #    the caller's, in one short transaction (FOR UPDATE SKIP LOCKED: no two claims take the
    #    same member); the row still belongs to the pool, so no tenant sees it yet.
    # 2. The caller asks the member's worker to hand the VM over (no transaction is open).
    # 3. `confirm_claim` gives the row to the tenant, only if the claim still holds it; or
    #    `abandon_claim` drops the member. A claim nobody confirmed or abandoned within the
    #    controller's grace period (the API died between two steps) is dropped by the
    #    reconciler: its VM may already hold the tenant's environment, but no tenant ever got
    #    it, so nothing of anyone's is lost.

    async def claim_member(self, values: dict[str, Any], token: str) -> dict[str, Any] | None:
        """Mark a ready member of this shape as claimed by `token`; None if there is none. The
        row comes with its worker's URL (`worker_url`) and the leader's epoch (`epoch`)."""
        s, w = t.sandboxes.c, t.workers.c
        async with self.engine.begin() as c:
            q = (
                sa.select(s.id)
                .join(t.workers, w.id == s.worker_id)
                .join(t.templates, t.templates.c.id == s.template)
                .where(
                    t.templates.c.tenant_id.is_(None),  # a tenant's own has no pool to claim
                    s.pool,
                    s.state == "running",
                    s.desired_state == "running",
                    s.template == values["template"],
                    s.vcpus == values["vcpus"],
                    s.memory_mib == values["memory_mib"],
                    s.disk_mib == values["disk_mib"],
                    w.state == "active",
                    w.problem.is_(None),
                )
                .order_by(s.created_at)
                .limit(1)
                .with_for_update(of=t.sandboxes, skip_locked=True)
            )
            member_id = (await c.execute(q)).scalar()
            if member_id is None:
                return None
            upd = (
                t.sandboxes.update()
                .where(s.id == member_id)
                .values(state="claiming", claim_token=token, updated_at=sa.func.now())
                .returning(*t.sandboxes.c)
            )
            member = (await c.execute(upd)).mappings().one()
            url, epoch = await worker_and_epoch(c, member["worker_id"])
        return {**member, "worker_url": url, "epoch": epoch}

    async def confirm_claim(
        self,
        member_id: str,
        token: str,
        tenant_id: str,
        values: dict[str, Any],
        quotas: Quotas | None = None,
    ) -> Row | None:
        """The claimed member becomes the tenant's running sandbox; None if the claim was
        given up meanwhile (too late: the controller dropped it). Refused (429) if it would
        put the tenant past `quotas`."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            quotas = await lock_for(c, tenant_id, quotas)
            q = (
                t.sandboxes.update()
                .where(
                    s.id == member_id,
                    s.state == "claiming",
                    s.claim_token == token,
                    s.desired_state == "running",
                )
                .values(
                    tenant_id=tenant_id,
                    pool=False,
                    state="running",
                    boot="pool",
                    reason=None,
                    claim_token=None,
                    env=values["env"],
                    network=values["network"],
                    secrets=values["secrets"],
                    metadata=values["metadata"],
                    timeout_s=values["timeout_s"],
                    timeout_action=values["timeout_action"],
                    idle_timeout_s=values.get("idle_timeout_s"),
                    idempotency_key=values.get("idempotency_key"),
                    request_id=values.get("request_id"),
                    trace_parent=values.get("trace_parent"),
                    expires_at=sa.func.now() + timedelta(seconds=values["timeout_s"]),
                    created_at=sa.func.now(),
                    updated_at=sa.func.now(),
                )
                .returning(*t.sandboxes.c)
            )
            row = (await c.execute(q)).mappings().first()
            if row is not None:
                await enforce_sandboxes(c, tenant_id, quotas)
                await event(c, row, "created", None, "running", "from the warm pool")
                await notify(c, member_id)
            return row

    async def abandon_claim(self, member_id: str, token: str | None, reason: str) -> bool:
        """Drop a claimed member (its hand-over failed, or was never confirmed); `token` None
        abandons whatever claim holds it."""
        s = t.sandboxes.c
        where = [s.id == member_id, s.state == "claiming", s.pool]
        if token is not None:
            where.append(s.claim_token == token)
        async with self.engine.begin() as c:
            return await drop_members(c, where, reason, claim_token=None) > 0


async def drop_members(c: AsyncConnection, where: list[Any], reason: str, **values: Any) -> int:
    """Ask for the pool members matching `where` to be deleted; how many were."""
    s = t.sandboxes.c
    rows = (
        await c.execute(
            t.sandboxes.update()
            .where(s.pool, s.desired_state != "deleted", *where)
            .values(desired_state="deleted", reason=reason, updated_at=sa.func.now(), **values)
            .returning(*t.sandboxes.c)
        )
    ).mappings()
    n = 0
    for row in rows:
        await event(c, row, "requested", row["state"], "deleted", reason)
        await notify(c, row["id"])
        n += 1
    return n

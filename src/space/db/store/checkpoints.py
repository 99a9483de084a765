"""Checkpoints and forks: a record, the worker's call, a confirmation (as claims are).

1. `begin_checkpoint` inserts a `creating` row with the tenant locked (its quotas checked: one
   being taken counts as its sandbox's memory until its size is known), and answers with the
   sandbox's worker and the leader's epoch for the call.
2. The API asks the worker (no transaction is open meanwhile).
3. `finish_checkpoint` makes it `ready` with its real size, or `drop_checkpoint` removes it.
   One the API left half-way (it died) is removed by the controller (`stale_checkpoints`).

A fork's children are asked of the worker first and inserted afterwards (`insert_forks`, the
quotas checked again with the tenant locked); children whose rows never came (the API died)
are removed by the worker's reconcile, since no row keeps them. A sandbox's checkpoints go with
it: its rows when it is deleted (`transition`), its files with its VM on the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from space import quotas as q
from space.db import tables as t
from space.db.store.base import Conflict, NotFound, Refused, Row, event, new_id, notify
from space.db.store.leases import worker_and_epoch
from space.db.store.quotas import QuotaQueries, checkpoint_usage, enforce_sandboxes, lock_for


async def _sandbox(c: AsyncConnection, tenant_id: str, sandbox_id: str) -> Row:
    s = t.sandboxes.c
    q_ = sa.select(t.sandboxes).where(s.id == sandbox_id, s.tenant_id == tenant_id)
    row = (await c.execute(q_.with_for_update())).mappings().first()
    if row is None:
        raise NotFound(sandbox_id)
    return row


class CheckpointQueries(QuotaQueries):
    async def begin_checkpoint(
        self, tenant_id: str, sandbox_id: str, name: str, quotas: q.Quotas | None
    ) -> tuple[Row, str, int]:
        """A `creating` checkpoint of a running sandbox, its worker's URL and the epoch."""
        async with self.engine.begin() as c:
            quotas = await lock_for(c, tenant_id, quotas)
            sb = await _sandbox(c, tenant_id, sandbox_id)
            if sb["state"] != "running" or sb["desired_state"] != "running":
                raise Conflict(sandbox_id, sb["state"], "checkpoint it (it must be running)")
            row = (
                (
                    await c.execute(
                        t.checkpoints.insert()
                        .values(
                            id=new_id("ck"),
                            tenant_id=tenant_id,
                            sandbox_id=sandbox_id,
                            worker_id=sb["worker_id"],
                            name=name,
                            state="creating",
                        )
                        .returning(*t.checkpoints.c)
                    )
                )
                .mappings()
                .one()
            )
            if quotas is not None and (why := q.over(quotas, await checkpoint_usage(c, tenant_id))):
                raise Refused(429, why)
            url, epoch = await worker_and_epoch(c, sb["worker_id"])
            return row, url, epoch

    async def finish_checkpoint(
        self, checkpoint_id: str, size_bytes: int, paused_ms: float
    ) -> Row | None:
        """The checkpoint is ready; None if it went meanwhile (its sandbox was deleted)."""
        k = t.checkpoints.c
        async with self.engine.begin() as c:
            upd = (
                t.checkpoints.update()
                .where(k.id == checkpoint_id, k.state == "creating")
                .values(state="ready", size_bytes=size_bytes, paused_ms=paused_ms)
                .returning(*t.checkpoints.c)
            )
            return (await c.execute(upd)).mappings().first()

    async def drop_checkpoint(self, checkpoint_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(t.checkpoints.delete().where(t.checkpoints.c.id == checkpoint_id))

    async def checkpoints_of(self, tenant_id: str, sandbox_id: str) -> list[Row]:
        """A sandbox's checkpoints, oldest first (NotFound for another tenant's sandbox)."""
        k = t.checkpoints.c
        async with self.engine.connect() as c:
            await _exists(c, tenant_id, sandbox_id)
            found = await c.execute(
                sa.select(t.checkpoints)
                .where(k.sandbox_id == sandbox_id, k.tenant_id == tenant_id)
                .order_by(k.created_at, k.id)
            )
            return list(found.mappings())

    async def with_checkpoints(self, sandbox_ids: Sequence[str]) -> set[str]:
        """Those of the sandboxes that have checkpoints (their files are on their worker)."""
        k = t.checkpoints.c
        q = sa.select(k.sandbox_id).where(k.sandbox_id.in_(list(sandbox_ids))).distinct()
        async with self.engine.connect() as c:
            return {r[0] for r in await c.execute(q)}

    async def checkpoint(
        self, tenant_id: str, sandbox_id: str, checkpoint_id: str
    ) -> tuple[Row, str, int]:
        """One checkpoint of the tenant's sandbox, its worker's URL and the epoch."""
        k = t.checkpoints.c
        async with self.engine.connect() as c:
            row = (
                (
                    await c.execute(
                        sa.select(t.checkpoints).where(
                            k.id == checkpoint_id,
                            k.sandbox_id == sandbox_id,
                            k.tenant_id == tenant_id,
                        )
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                raise NotFound(checkpoint_id)
            url, epoch = await worker_and_epoch(c, row["worker_id"])
            return row, url, epoch

    async def stale_checkpoints(self, older_than_s: float) -> list[Row]:
        """Checkpoints still `creating` or `deleting` long after any call for them ended: the
        API died between its steps."""
        k = t.checkpoints.c
        q = sa.select(t.checkpoints).where(
            k.state.in_(("creating", "deleting")),
            k.created_at < sa.func.now() - timedelta(seconds=older_than_s),
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def mark_deleting(self, checkpoint_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(
                t.checkpoints.update()
                .where(t.checkpoints.c.id == checkpoint_id)
                .values(state="deleting")
            )

    async def sandbox_event(self, row: Row, kind: str, reason: str) -> None:
        """Something done to a running sandbox that changes no state (a rollback, a fork)."""
        async with self.engine.begin() as c:
            await event(c, row, kind, row["state"], row["state"], reason)
            await notify(c, row["id"])

    async def fork_source(
        self, tenant_id: str, sandbox_id: str, count: int, quotas: q.Quotas
    ) -> tuple[Row, str, int]:
        """The sandbox to fork (running), its worker's URL and the epoch; 429 at once if
        `count` children would put the tenant past a quota (checked again at the insert)."""
        async with self.engine.connect() as c:
            sb = (
                (
                    await c.execute(
                        sa.select(t.sandboxes).where(
                            t.sandboxes.c.id == sandbox_id, t.sandboxes.c.tenant_id == tenant_id
                        )
                    )
                )
                .mappings()
                .first()
            )
            if sb is None:
                raise NotFound(sandbox_id)
            if sb["state"] != "running" or sb["desired_state"] != "running":
                raise Conflict(sandbox_id, sb["state"], "fork it (it must be running)")
            url, epoch = await worker_and_epoch(c, sb["worker_id"])
        limits, used = await self.quotas_of(tenant_id, quotas)
        adding = {"sandboxes": count, "vcpus": count * sb["vcpus"],
                  "memory_mib": count * sb["memory_mib"],
                  "disk_mib": count * sb["disk_mib"]}  # fmt: skip
        if why := q.over(limits, {k: used[k] + n for k, n in adding.items()}):
            raise Refused(429, why)
        return sb, url, epoch

    async def insert_forks(
        self, parent: Row, children: list[dict[str, Any]], quotas: q.Quotas | None
    ) -> list[Row]:
        """Rows for the running children of `parent` (each: id, env, metadata); Refused (429,
        nothing inserted) if they put the tenant past a quota."""
        tenant_id = parent["tenant_id"]
        inherited = {k: parent[k] for k in ("template", "vcpus", "memory_mib", "disk_mib",
                                            "timeout_s", "timeout_action", "network", "secrets",
                                            "worker_id")}  # fmt: skip
        rows = []
        async with self.engine.begin() as c:
            quotas = await lock_for(c, tenant_id, quotas)
            for child in children:
                ins = t.sandboxes.insert().values(
                    tenant_id=tenant_id, state="running", desired_state="running", boot="fork",
                    expires_at=sa.func.now() + timedelta(seconds=parent["timeout_s"]),
                    **inherited, **child,
                ).returning(*t.sandboxes.c)  # fmt: skip
                row = (await c.execute(ins)).mappings().one()
                await event(c, row, "created", None, "running", f"fork of {parent['id']}")
                await notify(c, row["id"])
                rows.append(row)
            await enforce_sandboxes(c, tenant_id, quotas)
        return rows


async def _exists(c: AsyncConnection, tenant_id: str, sandbox_id: str) -> None:
    s = t.sandboxes.c
    found = await c.execute(sa.select(s.id).where(s.id == sandbox_id, s.tenant_id == tenant_id))
    if found.first() is None:
        raise NotFound(sandbox_id)

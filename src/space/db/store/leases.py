"""Leases: who leads the controllers, until when, and the epoch that fences a lost leader.

A replica takes the lease when it is free or expired (the epoch grows by one), renews it well
before it expires, and stops acting as soon as it cannot show a renewal within its deadline.
Writers that must not act for a stale leader check the epoch in the same statement
(`fenced()`).
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import Queries

LEADER = "controller"


def fenced(epoch: int) -> sa.ColumnElement[bool]:
    """True only while `epoch` is still the leader's (for the WHERE of a leader's write)."""
    current = sa.select(t.leases.c.epoch).where(t.leases.c.name == LEADER).scalar_subquery()
    return current == epoch


async def worker_and_epoch(c: AsyncConnection, worker_id: str) -> tuple[str, int]:
    """A worker's URL and the leader's epoch, for a lifecycle call the API makes itself."""
    epoch = sa.select(t.leases.c.epoch).where(t.leases.c.name == LEADER).scalar_subquery()
    w = t.workers.c
    url, lease_epoch = (
        await c.execute(sa.select(w.url, sa.func.coalesce(epoch, 0)).where(w.id == worker_id))
    ).one()
    return str(url), int(lease_epoch)


class LeaseQueries(Queries):
    async def take_lease(self, holder: str, ttl_s: float) -> int | None:
        """The lease for `holder` if it is free, expired or already theirs: its epoch (a new
        one unless `holder` held it); None while another holds it."""
        l = t.leases.c  # noqa: E741
        expires = sa.func.now() + timedelta(seconds=ttl_s)
        q = (
            pg_insert(t.leases)
            .values(name=LEADER, holder=holder, epoch=1, expires_at=expires)
            .on_conflict_do_update(
                index_elements=[l.name],
                set_={
                    "holder": holder,
                    "expires_at": expires,
                    "epoch": sa.case((l.holder == holder, l.epoch), else_=l.epoch + 1),
                },
                where=sa.or_(l.expires_at < sa.func.now(), l.holder == holder),
            )
            .returning(l.epoch)
        )
        async with self.engine.begin() as c:
            epoch = (await c.execute(q)).scalar()
        return None if epoch is None else int(epoch)

    async def renew_lease(self, holder: str, epoch: int, ttl_s: float) -> bool:
        """Extend a lease still held; False if it was lost (expired and taken)."""
        l = t.leases.c  # noqa: E741
        q = (
            t.leases.update()
            .where(l.name == LEADER, l.holder == holder, l.epoch == epoch)
            .values(expires_at=sa.func.now() + timedelta(seconds=ttl_s))
        )
        async with self.engine.begin() as c:
            return (await c.execute(q)).rowcount == 1

    async def release_lease(self, holder: str, epoch: int) -> None:
        """Give it up at once (a clean stop), so a standby need not wait for it to expire."""
        l = t.leases.c  # noqa: E741
        q = (
            t.leases.update()
            .where(l.name == LEADER, l.holder == holder, l.epoch == epoch)
            .values(expires_at=sa.func.now() - timedelta(seconds=1))
        )
        async with self.engine.begin() as c:
            await c.execute(q)

    async def lease_epoch(self) -> int:
        """The current leader's epoch (0 before anyone led)."""
        q = sa.select(t.leases.c.epoch).where(t.leases.c.name == LEADER)
        async with self.engine.connect() as c:
            return int((await c.execute(q)).scalar() or 0)

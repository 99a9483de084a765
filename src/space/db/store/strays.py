"""Strays: sandboxes a worker holds that the database has never heard of (it was restored from
a backup taken before they were made). They are kept, and reported, until an operator discards
them (`space admin strays --discard`); only then does the clean-up delete them."""

from __future__ import annotations

from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from space.db import tables as t
from space.db.store.base import Queries


class StrayQueries(Queries):
    async def unknown_sandboxes(self, ids: Iterable[str]) -> set[str]:
        """Those of `ids` no sandbox row has ever had (rows are never removed)."""
        wanted = set(ids)
        if not wanted:
            return set()
        s = t.sandboxes.c
        async with self.engine.connect() as c:
            known = (await c.execute(sa.select(s.id).where(s.id.in_(wanted)))).scalars()
            return wanted - set(known)

    async def found_strays(self, worker_id: str, ids: set[str]) -> set[str]:
        """Record the strays `worker_id` holds now (forgetting those it no longer holds); the
        ones an operator discarded."""
        st = t.strays.c
        async with self.engine.begin() as c:
            await c.execute(t.strays.delete().where(st.worker_id == worker_id, st.id.not_in(ids)))
            if ids:
                await c.execute(
                    pg_insert(t.strays)
                    .values([{"id": i, "worker_id": worker_id} for i in sorted(ids)])
                    .on_conflict_do_update(index_elements=[st.id], set_={"worker_id": worker_id})
                )
            q = sa.select(st.id).where(st.worker_id == worker_id, st.discarded)
            return set((await c.execute(q)).scalars())

    async def discard_stray(self, stray_id: str) -> bool:
        async with self.engine.begin() as c:
            q = t.strays.update().where(t.strays.c.id == stray_id).values(discarded=True)
            return (await c.execute(q)).rowcount == 1

    async def strays(self) -> list[tuple[str, str, bool]]:
        """(id, worker, discarded) of every stray, by worker."""
        st = t.strays.c
        async with self.engine.connect() as c:
            q = sa.select(st.id, st.worker_id, st.discarded).order_by(st.worker_id, st.id)
            return [(r.id, r.worker_id, r.discarded) for r in await c.execute(q)]

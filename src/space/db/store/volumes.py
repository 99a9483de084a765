"""Volumes: a tenant's disks that outlive sandboxes, and who has them attached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import Queries, Refused, Row, new_id
from space.db.store.quotas import enforce_volumes, lock_for
from space.quotas import Quotas


class VolumeQueries(Queries):
    async def create_volume(
        self, tenant_id: str, name: str, size_mib: int, quotas: Quotas | None = None
    ) -> Row:
        """A new volume; Refused (429) if it would put the tenant past `quotas`."""
        values = {"id": new_id("vol"), "tenant_id": tenant_id, "name": name,
                  "size_mib": size_mib, "state": "available"}  # fmt: skip
        async with self.engine.begin() as c:
            quotas = await lock_for(c, tenant_id, quotas)
            q = t.volumes.insert().values(**values).returning(*t.volumes.c)
            row = (await c.execute(q)).mappings().one()
            await enforce_volumes(c, tenant_id, quotas)
            return row

    async def volumes(self, tenant_id: str) -> list[Row]:
        v = t.volumes.c
        q = (
            sa.select(t.volumes)
            .where(v.tenant_id == tenant_id, v.state != "deleted")
            .order_by(v.created_at.desc(), v.id)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def volume(self, volume_id: str, tenant_id: str | None = None) -> Row:
        q = sa.select(t.volumes).where(t.volumes.c.id == volume_id)
        if tenant_id is not None:
            q = q.where(t.volumes.c.tenant_id == tenant_id, t.volumes.c.state != "deleted")
        async with self.engine.connect() as c:
            row = (await c.execute(q)).mappings().first()
        if row is None:
            raise Refused(404, f"no volume {volume_id}")
        return row

    async def delete_volume(self, tenant_id: str, volume_id: str) -> Row:
        """Ask for a volume's deletion; refused while any sandbox not deleted has it."""
        v = t.volumes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        sa.select(t.volumes)
                        .where(v.id == volume_id, v.tenant_id == tenant_id, v.state != "deleted")
                        .with_for_update()
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                raise Refused(404, f"no volume {volume_id}")
            users = await _attachments(c, volume_id)
            if users:
                names = ", ".join(sorted(u["id"] for u in users))
                raise Refused(409, f"volume {volume_id} is attached to {names}")
            state = "deleting" if row["worker_id"] else "deleted"
            q = t.volumes.update().where(v.id == volume_id).values(state=state)
            return (await c.execute(q.returning(*t.volumes.c))).mappings().one()

    async def volumes_to_delete(self) -> list[Row]:
        """Volumes asked to be deleted that no sandbox has any more (a deleted tenant's wait
        for their sandboxes' deletion)."""
        s = t.sandboxes.c
        attached = sa.exists().where(
            s.volumes.contains(sa.func.jsonb_build_array(
                sa.func.jsonb_build_object("volume", t.volumes.c.id))),
            s.state != "deleted",
        )  # fmt: skip
        q = sa.select(t.volumes).where(t.volumes.c.state == "deleting", ~attached)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def volume_deleted(self, volume_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(
                t.volumes.update().where(t.volumes.c.id == volume_id).values(state="deleted")
            )

    async def sandbox_volumes(self, row: Row) -> list[dict[str, Any]]:
        """A sandbox's volumes as its worker needs them: id, size, where and how mounted."""
        wanted = {a["volume"]: a for a in row["volumes"]}
        if not wanted:
            return []
        q = sa.select(t.volumes).where(t.volumes.c.id.in_(list(wanted)))
        async with self.engine.connect() as c:
            sizes = {r["id"]: r for r in (await c.execute(q)).mappings()}
        return [
            {"id": vid, "size_mib": sizes[vid]["size_mib"], "path": a["path"],
             "read_only": bool(a.get("read_only", False)), "worker_id": sizes[vid]["worker_id"]}
            for vid, a in wanted.items()
        ]  # fmt: skip

    async def bind_volumes(self, volume_ids: Sequence[str], worker_id: str) -> None:
        """Volumes live where they are first used: later sandboxes must go there too. A
        sandbox placed with them may write them: their image in the registry, if any, is out
        of date from now on (and a push under way is dropped when it ends)."""
        v = t.volumes.c
        ids = list(volume_ids)
        async with self.engine.begin() as c:
            await c.execute(
                t.volumes.update()
                .where(v.id.in_(ids), v.worker_id.is_(None))
                .values(worker_id=worker_id)
            )
            await c.execute(t.volumes.update().where(v.id.in_(ids))
                            .values(artifact=None, generation=v.generation + 1))  # fmt: skip

    async def volumes_to_push(self) -> list[Row]:
        """Volumes no sandbox has whose image is only on their worker, which has a registry."""
        v, w = t.volumes.c, t.workers.c
        q = (
            sa.select(t.volumes, w.url)
            .join(t.workers, w.id == v.worker_id)
            .where(v.state == "available", v.artifact.is_(None), w.registry, w.state == "active")
        )
        async with self.engine.connect() as c:
            rows = list((await c.execute(q)).mappings())
            return [r for r in rows if not await _attachments(c, r["id"])]

    async def volumes_to_move(self) -> list[Row]:
        """Volumes no sandbox has, their image in the registry, whose worker is lost or being
        drained: they move to another before a sandbox needs them."""
        v, w = t.volumes.c, t.workers.c
        q = (
            sa.select(t.volumes)
            .join(t.workers, w.id == v.worker_id)
            .where(
                v.state == "available",
                v.artifact.is_not(None),
                sa.or_(w.state != "active", w.draining),
            )
        )
        async with self.engine.connect() as c:
            rows = list((await c.execute(q)).mappings())
            return [r for r in rows if not await _attachments(c, r["id"])]

    async def volume_pushed(self, volume: Row, artifact: str) -> bool:
        """Its image is in the registry: kept only if no sandbox was placed with it or has it,
        and it did not move, since `volume` was read."""
        return await self._if_unchanged(volume, artifact=artifact)

    async def volume_moved(self, volume: Row, worker_id: str) -> bool:
        """Its image pulled by `worker_id`, where it lives from now on: only if nothing
        changed since `volume` was read."""
        return await self._if_unchanged(volume, worker_id=worker_id)

    async def _if_unchanged(self, volume: Row, **values: Any) -> bool:
        v = t.volumes.c
        async with self.engine.begin() as c:
            q = sa.select(v.worker_id, v.generation).where(v.id == volume["id"]).with_for_update()
            now = (await c.execute(q)).first()
            if (now is None or (now.worker_id, now.generation)
                    != (volume["worker_id"], volume["generation"])
                    or await _attachments(c, volume["id"])):  # fmt: skip
                return False
            await c.execute(t.volumes.update().where(v.id == volume["id"]).values(**values))
            return True


async def check_attachments(
    c: AsyncConnection, tenant_id: str, attachments: list[dict[str, Any]]
) -> None:
    """The tenant's volumes, free to attach as asked: one writer, or any readers."""
    v = t.volumes.c
    ids = [a["volume"] for a in attachments]
    q = (
        sa.select(t.volumes)
        .where(v.id.in_(ids), v.tenant_id == tenant_id, v.state == "available")
        .order_by(v.id)
        .with_for_update()  # concurrent creates attaching the same volume queue here
    )
    found = {r["id"] for r in (await c.execute(q)).mappings()}
    for a in attachments:
        vid = a["volume"]
        if vid not in found:
            raise Refused(404, f"no volume {vid}")
        users = await _attachments(c, vid)
        writers = [u["id"] for u in users if not u["read_only"]]
        if writers:
            raise Refused(409, f"volume {vid} is attached read-write to {', '.join(writers)}")
        if users and not a.get("read_only"):
            names = ", ".join(u["id"] for u in users)
            raise Refused(
                409, f"volume {vid} is attached read-only to {names}: no writer meanwhile"
            )


async def _attachments(c: AsyncConnection, volume_id: str) -> list[dict[str, Any]]:
    """Sandboxes not deleted that have the volume: id and whether read-only."""
    s = t.sandboxes.c
    q = sa.select(s.id, s.volumes).where(
        s.volumes.contains([{"volume": volume_id}]), s.state != "deleted"
    )
    out = []
    for row in await c.execute(q):
        for a in row.volumes:
            if a["volume"] == volume_id:
                out.append({"id": row.id, "read_only": bool(a.get("read_only", False))})
    return out

"""Templates: the platform's `base`, builds asked for and made on workers, and pool sizes."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import NotFound, Queries, Refused, Row
from space.db.store.pools import drop_members


@dataclass(frozen=True)
class Snapshot:
    """A template that is one tenant's own: made of the state of `sandbox_id` (or built by
    E2B's template builder, of none), named `label`."""

    tenant_id: str
    sandbox_id: str | None
    label: str | None
    held_bytes: int  # what it holds: its checkpoint's size


Usable = Literal["shared", "own"]


def visible(tenant_id: str) -> sa.ColumnElement[bool]:
    """Templates the tenant sees: every tenant's, and its own."""
    tp = t.templates.c
    return sa.or_(tp.tenant_id.is_(None), tp.tenant_id == tenant_id)


def build_context(template_id: str) -> str:
    """What a build's sealed registry credentials are bound to (they open for no other)."""
    return f"build:{template_id}"


class TemplateQueries(Queries):
    async def ensure_template(self, template_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(pg_insert(t.templates).values(id=template_id).on_conflict_do_nothing())

    async def template_record(
        self, template_id: str, tenant_id: str | None = None
    ) -> dict[str, Any] | None:
        """What the last good build of a template made (its worker's template.json); None
        also for one `tenant_id` does not see."""
        q = sa.select(t.templates.c.record).where(t.templates.c.id == template_id)
        if tenant_id is not None:
            q = q.where(visible(tenant_id))
        async with self.engine.connect() as c:
            record = (await c.execute(q)).scalar()
        return dict(record) if record else None

    async def usable_template(self, template_id: str, tenant_id: str) -> Usable | None:
        """Whether the tenant can make sandboxes of it (None if not): `base`, or a template
        built at least once (a rebuild under way leaves the last build usable), not being
        deleted, and every tenant's ("shared") or this one's ("own")."""
        tp = t.templates.c
        q = sa.select(tp.tenant_id).where(
            tp.id == template_id,
            tp.state != "deleting",
            sa.or_(tp.record.is_not(None), sa.and_(tp.worker_id.is_(None), tp.state == "ready")),
            visible(tenant_id),
        )
        async with self.engine.connect() as c:
            found = (await c.execute(q)).first()
        return None if found is None else "shared" if found.tenant_id is None else "own"

    async def template_worker(self, template_id: str) -> str | None:
        """The one worker a template's sandboxes can run on: the one it was built on, unless
        its build is in the registry (None: any worker, as for `base`)."""
        tp = t.templates.c
        async with self.engine.connect() as c:
            q = sa.select(tp.worker_id, tp.record).where(tp.id == template_id)
            row = (await c.execute(q)).first()
        if row is None or (row.record or {}).get("artifact"):
            return None
        return str(row.worker_id) if row.worker_id else None

    # --- builds: asked for by the API, started by the controller --------------------------

    async def request_build(
        self, template_id: str, request_id: str, spec: str, context: bytes,
        environ: tuple[str, bytes] | None, checkpoint: Row | None = None,
        tenant_id: str | None = None, private: Snapshot | None = None,
    ) -> Row:  # fmt: skip
        """Queue a build of a template (made by its first build); Refused while one is queued,
        under way or the template is being deleted. `environ` is (key id, sealed JSON). A
        build of a `checkpoint` runs on its worker: refused for a template that lives on
        another. A `private` template is its tenant's alone (404 to any other's build)."""
        tp = t.templates.c
        own = {} if private is None else {
            "tenant_id": private.tenant_id, "source_sandbox_id": private.sandbox_id,
            "label": private.label, "held_bytes": private.held_bytes,
        }  # fmt: skip
        # A snapshot that replaces one of its name is the newest, of its own sandbox.
        again = {} if private is None else {**own, "created_at": sa.func.now()}
        async with self.engine.begin() as c:
            await c.execute(pg_insert(t.templates).values(id=template_id, state="queued", **own)
                            .on_conflict_do_nothing())  # fmt: skip
            row = (
                (await c.execute(sa.select(t.templates).where(tp.id == template_id)
                                 .with_for_update()))
                .mappings()
                .one()
            )  # fmt: skip
            queued = await c.execute(
                sa.select(t.template_builds.c.template_id).where(
                    t.template_builds.c.template_id == template_id
                )
            )
            if row["tenant_id"] != (private.tenant_id if private else None):
                if private is not None:  # another tenant's, or every tenant's: not for its name
                    raise Refused(404, f"no template {template_id} of yours")
                raise Refused(409, f"template {template_id} is a tenant's own snapshot")
            if row["state"] in ("building", "deleting") or queued.first() is not None:
                state = "queued" if row["state"] not in ("building", "deleting") else row["state"]
                raise Refused(409, f"template {template_id} is {state}")
            home = None if (row["record"] or {}).get("artifact") else row["worker_id"]
            if checkpoint is not None and home not in (None, checkpoint["worker_id"]):
                raise Refused(
                    409, f"template {template_id} lives on worker {home}, and checkpoint "
                    f"{checkpoint['id']} on worker {checkpoint['worker_id']}: choose another name",
                )  # fmt: skip
            await c.execute(
                t.template_builds.insert().values(
                    template_id=template_id, request_id=request_id, spec=spec, context=context,
                    environ_key_id=environ[0] if environ else None,
                    environ_sealed=environ[1] if environ else None,
                    checkpoint_id=checkpoint["id"] if checkpoint is not None else None,
                    tenant_id=tenant_id,
                )
            )  # fmt: skip
            q = (
                t.templates.update()
                .where(tp.id == template_id)
                .values(state="queued", error=None, updated_at=sa.func.now(), **again)
                .returning(*t.templates.c)
            )
            return (await c.execute(q)).mappings().one()

    async def queued_builds(self) -> list[Row]:
        """Builds asked for and not started yet, with the template's home worker if it has one
        (and whether its last build is in the registry: `artifact`) and, for a build of a
        checkpoint, that checkpoint's sandbox, worker and state (None if it is gone)."""
        b, tp, k = t.template_builds.c, t.templates.c, t.checkpoints.c
        q = (
            sa.select(
                t.template_builds,
                tp.worker_id,
                tp.record["artifact"].astext.label("artifact"),
                k.sandbox_id.label("checkpoint_sandbox"),
                k.worker_id.label("checkpoint_worker"),
                k.state.label("checkpoint_state"),
            )
            .join(t.templates, tp.id == b.template_id)
            .outerjoin(t.checkpoints, k.id == b.checkpoint_id)
            .order_by(b.requested_at)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def begin_build(
        self, template_id: str, request_id: str, worker_id: str, build_id: str
    ) -> Row | None:
        """A queued build started on its worker: the request goes, the template is building.
        None if that request is no longer the queued one."""
        b = t.template_builds.c
        values = {"state": "building", "worker_id": worker_id, "build_id": build_id,
                  "error": None, "updated_at": sa.func.now()}  # fmt: skip
        async with self.engine.begin() as c:
            gone = await c.execute(
                t.template_builds.delete()
                .where(b.template_id == template_id, b.request_id == request_id)
                .returning(b.tenant_id)
            )
            asked = gone.first()
            if asked is None:
                return None
            values["build_tenant_id"] = asked.tenant_id
            q = (
                t.templates.update()
                .where(t.templates.c.id == template_id)
                .values(**values)
                .returning(*t.templates.c)
            )
            return (await c.execute(q)).mappings().one()

    async def fail_queued_build(self, template_id: str, request_id: str, error: str) -> None:
        """A queued build that cannot start (refused by its worker): the request goes."""
        b, tp = t.template_builds.c, t.templates.c
        async with self.engine.begin() as c:
            gone = await c.execute(
                t.template_builds.delete()
                .where(b.template_id == template_id, b.request_id == request_id)
                .returning(b.tenant_id)
            )
            asked = gone.first()
            if asked is not None:
                # Back to ready if an earlier build is usable, else failed; with the reason.
                state = sa.case((tp.record.is_not(None), "ready"), else_="failed")
                await c.execute(
                    t.templates.update()
                    .where(tp.id == template_id)
                    .values(state=state, error=error, updated_at=sa.func.now())
                )
                await _announce(c, template_id, asked.tenant_id, "failed", error)

    async def finish_build(
        self, template_id: str, build_id: str, record: dict[str, Any] | None, error: str | None
    ) -> None:
        """A build ended: with its template's record, or with what went wrong (the last good
        build, if any, stays in use). A template made of a checkpoint has that checkpoint's
        shape: so has its warm pool from now on (members of another shape are let go)."""
        tp, s = t.templates.c, t.sandboxes.c
        values: dict[str, Any] = {"state": "failed" if error else "ready", "error": error,
                                  "updated_at": sa.func.now()}  # fmt: skip
        if error:
            record = None  # whatever it made is not in use
        shape = (record or {}).get("vcpus"), (record or {}).get("memory_mib")
        if record is not None:
            values["record"] = record
        if shape[0] is not None:
            values |= {"pool_vcpus": shape[0], "pool_memory_mib": shape[1]}
        async with self.engine.begin() as c:
            done = await c.execute(
                t.templates.update()
                .where(tp.id == template_id, tp.build_id == build_id, tp.state == "building")
                .values(**values)
                .returning(tp.build_tenant_id)
            )
            ended = done.first()
            if ended is not None:
                await _announce(c, template_id, ended.build_tenant_id, values["state"], error)
            if ended is not None and shape[0] is not None:
                other = sa.tuple_(s.vcpus, s.memory_mib) != sa.tuple_(*shape)
                await drop_members(c, [s.template == template_id, other], "it changed shape")

    async def templates_in(self, state: str) -> list[Row]:
        q = sa.select(t.templates).where(t.templates.c.state == state)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def delete_template(self, template_id: str) -> Row:
        """Ask for a template's deletion: refused while a tenant's sandbox uses it; its pool
        is let go. The controller removes it from its worker once no sandbox needs it."""
        tp, s = t.templates.c, t.sandboxes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        sa.select(t.templates).where(tp.id == template_id).with_for_update()
                    )
                )
                .mappings()
                .first()
            )
            if row is None or row["state"] == "deleting":
                raise Refused(404, f"no template {template_id}")
            if row["state"] in ("queued", "building"):
                raise Refused(409, f"template {template_id} is being built: delete it after")
            if row["worker_id"] is None and row["tenant_id"] is None:
                raise Refused(409, f"{template_id} is the platform's own template: it stays")
            if row["worker_id"] is None:  # a snapshot never made anywhere: nothing to remove
                await c.execute(t.templates.delete().where(tp.id == template_id))
                return row
            users = await c.execute(
                sa.select(s.id)
                .where(s.template == template_id, s.state != "deleted", sa.not_(s.pool))
                .order_by(s.id)
                .limit(20)
            )
            ids = [r.id for r in users]
            if ids:
                raise Refused(409, f"template {template_id} is used by {', '.join(ids)}")
            await drop_members(c, [s.template == template_id], "the template is deleted")
            q = (
                t.templates.update()
                .where(tp.id == template_id)
                .values(state="deleting", pool_size=0, updated_at=sa.func.now())
                .returning(*t.templates.c)
            )
            return (await c.execute(q)).mappings().one()

    async def template_users(self, template_id: str) -> int:
        """Sandboxes (pool members included) of the template that are not deleted yet."""
        s = t.sandboxes.c
        q = sa.select(sa.func.count()).where(s.template == template_id, s.state != "deleted")
        async with self.engine.connect() as c:
            return int((await c.execute(q)).scalar_one())

    async def forget_template(self, template_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(t.templates.delete().where(t.templates.c.id == template_id))

    async def templates(
        self, template_id: str | None = None, tenant_id: str | None = None
    ) -> list[Row]:
        """Templates with how many pool members each has ready and on the way: every one, or
        those `tenant_id` sees (every tenant's and its own)."""
        s = t.sandboxes.c
        members = (
            sa.select(
                s.template,
                sa.func.count().filter(s.state == "running").label("pool_ready"),
                sa.func.count().filter(s.state != "running").label("pool_starting"),
            )
            .where(s.pool, s.desired_state == "running", s.state.not_in(("error", "deleted")))
            .group_by(s.template)
            .subquery()
        )
        q = (
            sa.select(
                t.templates,
                sa.func.coalesce(members.c.pool_ready, 0).label("pool_ready"),
                sa.func.coalesce(members.c.pool_starting, 0).label("pool_starting"),
            )
            .outerjoin(members, members.c.template == t.templates.c.id)
            .order_by(t.templates.c.id)
        )
        if template_id is not None:
            q = q.where(t.templates.c.id == template_id)
        if tenant_id is not None:
            q = q.where(visible(tenant_id))
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def snapshots(
        self, tenant_id: str, limit: int, *, sandbox_id: str | None = None,
        name: str | None = None, after: tuple[datetime, str] | None = None,
    ) -> list[Row]:  # fmt: skip
        """The tenant's snapshots (templates of its sandboxes' state) that sandboxes can be
        made of, oldest first, after (created_at, id); of one sandbox, or of one name or id."""
        tp = t.templates.c
        q = sa.select(t.templates).where(
            tp.tenant_id == tenant_id, tp.source_sandbox_id.is_not(None),
            tp.state != "deleting", tp.record.is_not(None),
        )  # fmt: skip
        if sandbox_id is not None:
            q = q.where(tp.source_sandbox_id == sandbox_id)
        if name is not None:
            q = q.where(sa.or_(tp.id == name, tp.label == name))
        if after is not None:
            q = q.where(sa.tuple_(tp.created_at, tp.id) > sa.tuple_(*after))
        q = q.order_by(tp.created_at, tp.id).limit(limit)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def set_pool(
        self, template_id: str, size: int, vcpus: int, memory_mib: int, disk_mib: int
    ) -> None:
        """Size and shape of a template's warm pool; members of another shape are let go."""
        async with self.engine.begin() as c:
            res = await c.execute(
                t.templates.update()
                # A tenant's own template has no warm pool: a claim looks at no owner.
                .where(t.templates.c.id == template_id, t.templates.c.tenant_id.is_(None))
                .values(
                    pool_size=size,
                    pool_vcpus=vcpus,
                    pool_memory_mib=memory_mib,
                    pool_disk_mib=disk_mib,
                )
            )
            if res.rowcount != 1:
                raise NotFound(template_id)
            s = t.sandboxes.c
            await drop_members(
                c,
                [
                    s.template == template_id,
                    sa.tuple_(s.vcpus, s.memory_mib, s.disk_mib)
                    != sa.tuple_(vcpus, memory_mib, disk_mib),
                ],
                "the pool changed shape",
            )


BUILD_EVENT = "build"  # an events row of a template's build that ended (webhooks.events)


def build_subject(template_id: str) -> str:
    """What a build's events row names instead of a sandbox (no sandbox id has a slash)."""
    return f"template/{template_id}"


async def _announce(
    c: AsyncConnection, template_id: str, tenant_id: str | None, state: str, error: str | None
) -> None:
    """The end of a build, as an event of the tenant whose key asked for it (if one did)."""
    if tenant_id is not None:
        await c.execute(t.events.insert().values(
            sandbox_id=build_subject(template_id), tenant_id=tenant_id, type=BUILD_EVENT,
            from_state="building", to_state=state, reason=error,
        ))  # fmt: skip

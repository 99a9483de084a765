"""Sandboxes: their rows, the states asked for, compare-and-set transitions, their events."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from space.db import tables as t
from space.db.store.base import TRANSITIONAL, Conflict, NotFound, Queries, Row, event, notify
from space.db.store.leases import fenced
from space.db.store.quotas import enforce_sandboxes, lock_for
from space.db.store.volumes import check_attachments
from space.quotas import Quotas


class SandboxQueries(Queries):
    async def create_sandbox(
        self, tenant_id: str, values: dict[str, Any], quotas: Quotas | None = None
    ) -> tuple[Row, bool]:
        """Insert a pending sandbox; with an idempotency key or id seen before, the old one.
        Refused (429) if it would put the tenant past `quotas` (None: no quotas).

        Returns (row, created)."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            quotas = await lock_for(c, tenant_id, quotas)
            if values.get("volumes"):
                await check_attachments(c, tenant_id, values["volumes"])
            ins = (
                pg_insert(t.sandboxes)
                .values(
                    tenant_id=tenant_id,
                    state="pending",
                    desired_state="running",
                    expires_at=sa.func.now() + timedelta(seconds=values["timeout_s"]),
                    **values,
                )
                .on_conflict_do_nothing()
                .returning(*t.sandboxes.c)
            )
            row = (await c.execute(ins)).mappings().first()
            if row is not None:
                await enforce_sandboxes(c, tenant_id, quotas)
                await event(c, row, "created", None, "pending", None)
                await notify(c, row["id"])
                return row, True
            # A conflict: the same id or idempotency key. Same tenant → the same sandbox.
            cond = s.id == values["id"]
            if values.get("idempotency_key"):
                cond = sa.or_(
                    cond,
                    sa.and_(
                        s.tenant_id == tenant_id,
                        s.idempotency_key == values["idempotency_key"],
                    ),
                )
            existing = (await c.execute(sa.select(t.sandboxes).where(cond))).mappings().first()
            if existing is None or existing["tenant_id"] != tenant_id:
                raise Conflict(values["id"], "taken", "use this id")
            return existing, False

    async def by_idempotency_key(self, tenant_id: str, key: str) -> Row | None:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(s.tenant_id == tenant_id, s.idempotency_key == key)
        async with self.engine.connect() as c:
            return (await c.execute(q)).mappings().first()

    async def get_sandbox(self, sandbox_id: str, tenant_id: str | None = None) -> Row:
        q = sa.select(t.sandboxes).where(t.sandboxes.c.id == sandbox_id)
        if tenant_id is not None:
            q = q.where(t.sandboxes.c.tenant_id == tenant_id)
        async with self.engine.connect() as c:
            row = (await c.execute(q)).mappings().first()
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def list_sandboxes(
        self,
        tenant_id: str,
        *,
        state: str | None = None,
        states: Sequence[str] | None = None,
        template: str | None = None,
        metadata: dict[str, str] | None = None,
        limit: int = 50,
        after: tuple[datetime, str] | None = None,
        deleted: bool = True,
        id_prefix: str | None = None,
    ) -> list[Row]:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(s.tenant_id == tenant_id)
        if not deleted:
            q = q.where(s.state != "deleted")
        if id_prefix:
            q = q.where(s.id.startswith(id_prefix, autoescape=True))
        if state:
            q = q.where(s.state == state)
        if states is not None:
            q = q.where(s.state.in_(states))
        if template:
            q = q.where(s.template == template)
        if metadata:
            q = q.where(s.metadata.contains(metadata))
        if after is not None:
            q = q.where(sa.tuple_(s.created_at, s.id) < sa.tuple_(*after))
        q = q.order_by(s.created_at.desc(), s.id.desc()).limit(limit)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def request(
        self,
        tenant_id: str,
        sandbox_id: str,
        desired: str,
        allowed_from: Sequence[str],
        verb: str,
        only_if_desired: str | None = None,
        request_id: str | None = None,
        idle: bool = False,
        reason: str | None = None,
        trace_parent: str | None = None,
    ) -> Row:
        """Ask for a new desired state; Conflict unless the current state allows it.
        `request_id`: the API request that asks (None: the platform itself); `idle`: the
        idle policy asks (the sandbox's next use resumes it)."""
        s = t.sandboxes.c
        conditions = [
            s.id == sandbox_id,
            s.tenant_id == tenant_id,
            s.state.in_(allowed_from),
            # A delete once asked for is never taken back by a later request.
            s.desired_state != "deleted",
        ]
        if only_if_desired is not None:
            conditions.append(s.desired_state == only_if_desired)
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(*conditions)
                        .values(
                            desired_state=desired,
                            request_id=request_id,
                            trace_parent=trace_parent,
                            idle_paused=idle,
                            updated_at=sa.func.now(),
                        )
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                current = await c.execute(
                    sa.select(s.state).where(s.id == sandbox_id, s.tenant_id == tenant_id)
                )
                state = current.scalar()
                if state is None:
                    raise NotFound(sandbox_id)
                raise Conflict(sandbox_id, state, verb)
            await event(c, row, "requested", row["state"], desired, reason)
            await notify(c, sandbox_id)
            return row

    async def set_network(
        self,
        tenant_id: str,
        sandbox_id: str,
        network: dict[str, Any],
        request_id: str | None = None,
        trace_parent: str | None = None,
    ) -> Row:
        """A new egress policy: its version grows; the controller puts it in force on the
        sandbox's worker and records that version as applied."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            q = (
                t.sandboxes.update()
                .where(s.id == sandbox_id, s.tenant_id == tenant_id, s.state != "deleted")
                .values(
                    network=network,
                    network_version=s.network_version + 1,
                    request_id=request_id,
                    trace_parent=trace_parent,
                    updated_at=sa.func.now(),
                )
                .returning(*t.sandboxes.c)
            )
            row = (await c.execute(q)).mappings().first()
            if row is not None:
                await notify(c, sandbox_id)
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def network_applied(self, sandbox_id: str, version: int, fence: int) -> None:
        """The policy of `version` is in force on the sandbox's worker."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            q = (
                t.sandboxes.update()
                .where(s.id == sandbox_id, s.network_applied < version, fenced(fence))
                .values(network_applied=version)
            )
            if (await c.execute(q)).rowcount:
                await notify(c, sandbox_id)

    async def set_timeout(self, tenant_id: str, sandbox_id: str, timeout_s: int) -> Row:
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(s.id == sandbox_id, s.tenant_id == tenant_id)
                        .values(
                            timeout_s=timeout_s,
                            expires_at=sa.func.now() + timedelta(seconds=timeout_s),
                            updated_at=sa.func.now(),
                        )
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .first()
            )
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def transition(
        self,
        sandbox_id: str,
        from_states: Sequence[str],
        to_state: str,
        *,
        reason: str | None = None,
        fence: int | None = None,
        where_worker: str | None = None,
        where_desired: str | None = None,
        **values: Any,
    ) -> Row | None:
        """Compare-and-set of `state`; None if the sandbox was not in `from_states`, if
        `fence` (a leader's epoch) is no longer the current one, or if it is no longer on
        `where_worker` or no longer wanted `where_desired` (when given)."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            q = sa.select(s.state).where(s.id == sandbox_id).with_for_update()
            if fence is not None:
                q = q.where(fenced(fence))
            if where_worker is not None:
                q = q.where(s.worker_id == where_worker)
            if where_desired is not None:
                q = q.where(s.desired_state == where_desired)
            before = (await c.execute(q)).scalar()
            if before is None or before not in from_states:
                return None
            if to_state == "running" and before != "running":
                # A sandbox's timeout runs from when it last started running.
                values.setdefault(
                    "expires_at",
                    sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, s.timeout_s),
                )
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(s.id == sandbox_id)
                        .values(state=to_state, reason=reason, updated_at=sa.func.now(), **values)
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .one()
            )
            if to_state == "deleted":  # its worker removed their files with its VM
                await c.execute(
                    t.checkpoints.delete().where(t.checkpoints.c.sandbox_id == sandbox_id)
                )
            await event(c, row, "state", before, to_state, reason)
            await notify(c, sandbox_id)
            return row

    async def sandboxes_to_reconcile(self, limit: int = 200) -> list[Row]:
        """Sandboxes whose state is not what was asked for (or is a transition under way)."""
        s = t.sandboxes.c
        q = (
            sa.select(t.sandboxes)
            .where(
                sa.or_(
                    s.state != s.desired_state,
                    s.state.in_(TRANSITIONAL),
                    sa.and_(
                        s.state.in_(("running", "paused")), s.network_applied < s.network_version
                    ),
                ),
                s.state != "deleted",
                sa.or_(s.state != "error", s.desired_state == "deleted"),
            )
            # Sandboxes waiting for room come last, so they never starve other work.
            .order_by(s.state == "pending", s.updated_at)
            .limit(limit)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def expired(self) -> list[Row]:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(
            s.expires_at < sa.func.now(),
            s.state == "running",
            s.desired_state == "running",
            sa.not_(s.pool),
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def on_worker(self, worker_id: str) -> list[Row]:
        q = sa.select(t.sandboxes).where(
            t.sandboxes.c.worker_id == worker_id, t.sandboxes.c.state != "deleted"
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def events(
        self, tenant_id: str, sandbox_id: str, after: int = 0, limit: int | None = None
    ) -> list[Row]:
        """Its events numbered after `after`, oldest first (at most `limit`)."""
        e = t.events.c
        q = (
            sa.select(t.events)
            .where(e.sandbox_id == sandbox_id, e.tenant_id == tenant_id, e.id > after)
            .order_by(e.id)
            .limit(limit)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

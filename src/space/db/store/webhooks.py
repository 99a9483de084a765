"""Webhooks: a tenant's endpoints (their signing secrets sealed), the deliveries owed to them,
and every attempt at one (space.webhooks)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.dialects.postgresql import insert as pg_insert

from space.db import tables as t
from space.db.sealing import Sealer
from space.db.store.base import NotFound, Queries, Refused, new_id
from space.db.store.quotas import lock_for

MAX_PER_TENANT = 20
SETTLE = timedelta(seconds=2)
SECRET_PREFIX = "whsec_"


@dataclass(frozen=True)
class Webhook:
    id: str
    tenant_id: str
    url: str
    events: list[str]
    description: str
    created_at: datetime


@dataclass(frozen=True)
class Due:
    """A delivery to attempt now, with what it takes to sign and send it."""

    id: int
    webhook_id: str
    tenant_id: str
    url: str
    secret: str
    type: str
    payload: dict[str, Any]
    attempts: int
    created_at: datetime


@dataclass(frozen=True)
class Attempt:
    at: datetime
    status: int | None
    error: str | None
    ms: float


@dataclass(frozen=True)
class Delivery:
    id: int
    event_id: int
    type: str
    payload: dict[str, Any]
    state: str  # pending, delivered or failed
    attempts: list[Attempt]
    created_at: datetime
    next_at: datetime


# Given the new events and the webhooks of their tenants: the deliveries to queue, as rows.
Planner = Callable[[list[sa.RowMapping], list[sa.RowMapping]], Iterable[Mapping[str, Any]]]


def _context(webhook_id: str) -> str:
    return f"webhook:{webhook_id}"


class WebhookQueries(Queries):
    async def create_webhook(
        self, tenant_id: str, url: str, events: list[str], description: str, sealer: Sealer
    ) -> tuple[Webhook, str]:
        """A new endpoint and its signing secret (shown once: only its sealed form is kept).
        It is owed the events that come after this moment."""
        webhook_id = new_id("wh")
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        key_id, sealed = sealer.seal(secret.encode(), _context(webhook_id))
        w = t.webhooks.c
        async with self.engine.begin() as c:
            # The tenant's row, locked: two creates at once never pass the limit together (nor
            # does one for a tenant deleted meanwhile).
            await lock_for(c, tenant_id, None)
            count = await c.execute(sa.select(sa.func.count()).where(w.tenant_id == tenant_id))
            if count.scalar_one() >= MAX_PER_TENANT:
                raise Refused(409, f"a tenant has at most {MAX_PER_TENANT} webhooks")
            newest = await c.execute(sa.select(sa.func.coalesce(sa.func.max(t.events.c.id), 0)))
            row = (
                (
                    await c.execute(
                        t.webhooks.insert()
                        .values(
                            id=webhook_id,
                            tenant_id=tenant_id,
                            url=url,
                            events=events,
                            description=description,
                            key_id=key_id,
                            sealed_secret=sealed,
                            after_event=newest.scalar_one(),
                        )
                        .returning(*_webhook_columns())
                    )
                )
                .mappings()
                .one()
            )
        return Webhook(**row), secret

    async def webhooks(self, tenant_id: str, webhook_id: str | None = None) -> list[Webhook]:
        w = t.webhooks.c
        q = sa.select(*_webhook_columns()).where(w.tenant_id == tenant_id).order_by(w.created_at)
        if webhook_id is not None:
            q = q.where(w.id == webhook_id)
        async with self.engine.connect() as c:
            return [Webhook(**r) for r in (await c.execute(q)).mappings()]

    async def delete_webhook(self, tenant_id: str, webhook_id: str) -> None:
        """It and what was owed to it go; nothing more is sent to it."""
        w = t.webhooks.c
        async with self.engine.begin() as c:
            gone = await c.execute(
                t.webhooks.delete().where(w.tenant_id == tenant_id, w.id == webhook_id)
            )
            if gone.rowcount != 1:
                raise NotFound(webhook_id)

    async def queue_deliveries(self, plan: Planner, limit: int = 500) -> int:
        """Read up to `limit` events past the cursor, queue what `plan` makes of them, and move
        the cursor past them, in one transaction (a leader that dies half way queues again,
        and the unique delivery of an event to an endpoint keeps it from being sent twice)."""
        e, w, cur = t.events.c, t.webhooks.c, t.webhook_cursor.c
        async with self.engine.begin() as c:
            q = sa.select(cur.event_id).where(cur.id == 1).with_for_update()
            after = (await c.execute(q)).scalar_one()
            # Ids are taken when a transaction starts, not when it commits: an event younger
            # than SETTLE may still have an older neighbour on its way; it waits for the next
            # pass, so none is passed over.
            settled = e.at < sa.func.now() - SETTLE
            q = sa.select(t.events).where(e.id > after, settled).order_by(e.id).limit(limit)
            events = list((await c.execute(q)).mappings())
            if not events:
                return 0
            tenants = {row["tenant_id"] for row in events}
            q = sa.select(w.id, w.tenant_id, w.events, w.after_event).where(
                w.tenant_id.in_(tenants)
            )
            hooks = list((await c.execute(q)).mappings())
            rows = [dict(r) for r in plan(events, hooks)]
            if rows:
                d = t.webhook_deliveries.c
                await c.execute(
                    pg_insert(t.webhook_deliveries)
                    .values(rows)
                    .on_conflict_do_nothing(index_elements=[d.webhook_id, d.event_id, d.type])
                )
            last = events[-1]["id"]
            await c.execute(t.webhook_cursor.update().where(cur.id == 1).values(event_id=last))
            return len(rows)

    async def due_deliveries(self, limit: int, busy: set[str], sealer: Sealer) -> list[Due]:
        """The oldest pending delivery whose time has come of each endpoint not in `busy` (one
        at a time to an endpoint: they arrive in order, but for those tried again), the
        endpoints that have waited longest first."""
        d, w = t.webhook_deliveries.c, t.webhooks.c
        heads = (
            sa.select(d.id, d.webhook_id, d.next_at)
            .ext(distinct_on(d.webhook_id))
            .where(d.state == "pending", d.next_at <= sa.func.now())
            .order_by(d.webhook_id, d.next_at, d.id)
        )
        if busy:
            heads = heads.where(d.webhook_id.not_in(busy))
        head = heads.subquery()
        q = (
            sa.select(
                d.id,
                d.webhook_id,
                w.tenant_id,
                w.url,
                w.key_id,
                w.sealed_secret,
                d.type,
                d.payload,
                d.attempts,
                d.created_at,
            )
            .join(head, head.c.id == d.id)
            .join(t.webhooks, w.id == d.webhook_id)
            .order_by(head.c.next_at, d.id)
            .limit(limit)
        )
        async with self.engine.connect() as c:
            rows = list((await c.execute(q)).mappings())
        return [
            Due(
                id=r["id"],
                webhook_id=r["webhook_id"],
                tenant_id=r["tenant_id"],
                url=r["url"],
                type=r["type"],
                payload=r["payload"],
                attempts=r["attempts"],
                created_at=r["created_at"],
                secret=sealer.open(
                    r["key_id"], bytes(r["sealed_secret"]), _context(r["webhook_id"])
                ).decode(),
            )
            for r in rows
        ]

    async def record_attempt(
        self, due: Due, status: int | None, error: str | None, ms: float,
        state: str, next_at: datetime | None,
    ) -> None:  # fmt: skip
        """One try and its outcome: `state` delivered, failed (given up) or pending (again at
        `next_at`, and the endpoint's later deliveries no sooner: a dead endpoint is tried once
        a backoff, not once a delivery)."""
        d = t.webhook_deliveries.c
        values: dict[str, Any] = {"state": state, "attempts": d.attempts + 1}
        if next_at is not None:
            values["next_at"] = next_at
        async with self.engine.begin() as c:
            await c.execute(t.webhook_attempts.insert().values(
                delivery_id=due.id, status=status, error=error, ms=ms))  # fmt: skip
            await c.execute(t.webhook_deliveries.update().where(d.id == due.id).values(**values))
            if next_at is not None:
                await c.execute(
                    t.webhook_deliveries.update()
                    .where(
                        d.webhook_id == due.webhook_id, d.state == "pending", d.next_at < next_at
                    )
                    .values(next_at=next_at)
                )

    async def deliveries(self, tenant_id: str, webhook_id: str, limit: int) -> list[Delivery]:
        """The newest `limit` deliveries of one of the tenant's webhooks, newest first, each
        with its attempts, oldest first."""
        if not await self.webhooks(tenant_id, webhook_id):
            raise NotFound(webhook_id)
        d, a = t.webhook_deliveries.c, t.webhook_attempts.c
        q = (sa.select(t.webhook_deliveries).where(d.webhook_id == webhook_id)
             .order_by(d.id.desc()).limit(limit))  # fmt: skip
        async with self.engine.connect() as c:
            rows = list((await c.execute(q)).mappings())
            ids = [r["id"] for r in rows]
            tries: dict[int, list[Attempt]] = {i: [] for i in ids}
            if ids:
                q2 = sa.select(t.webhook_attempts).where(a.delivery_id.in_(ids)).order_by(a.id)
                for r in (await c.execute(q2)).mappings():
                    tries[r["delivery_id"]].append(
                        Attempt(at=r["at"], status=r["status"], error=r["error"], ms=r["ms"])
                    )
        return [
            Delivery(
                id=r["id"],
                event_id=r["event_id"],
                type=r["type"],
                payload=r["payload"],
                state=r["state"],
                attempts=tries[r["id"]],
                created_at=r["created_at"],
                next_at=r["next_at"],
            )
            for r in rows
        ]


def _webhook_columns() -> list[sa.Column[Any]]:
    w = t.webhooks.c
    return [w.id, w.tenant_id, w.url, w.events, w.description, w.created_at]

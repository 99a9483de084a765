"""Metering: what sandboxes and volumes used, per time bucket and state, their gateway traffic by
host, and each tenant's running totals. The leader adds to them (space.controller.metering);
old buckets are rolled up into hours; the API reads them by tenant, sandbox, template or a
metadata label, over any range, at any step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any, Literal, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from space.db import tables as t
from space.db.store.base import Queries, Refused

T = TypeVar("T")
ROLLED_UP_S = 3600  # what old buckets become


@dataclass(frozen=True)
class Figures:
    """What adds up (tables.USAGE_FIGURES, in the same order)."""

    seconds: float = 0.0
    vcpu_seconds: float = 0.0
    memory_gib_seconds: float = 0.0
    cpu_seconds: float = 0.0
    disk_gib_hours: float = 0.0
    snapshot_gib_hours: float = 0.0
    checkpoint_gib_hours: float = 0.0
    volume_gib_hours: float = 0.0
    net_rx_bytes: int = 0
    net_tx_bytes: int = 0
    egress_bytes: int = 0
    ingress_bytes: int = 0


NAMES = [f.name for f in fields(Figures)]
KINDS = {n: int if kind is sa.BigInteger else float for n, kind in t.USAGE_FIGURES.items()}
assert list(t.USAGE_FIGURES) == NAMES, "Figures and the usage table must agree"


@dataclass(frozen=True)
class UsageSample:
    """What one sandbox or volume used in one bucket, in one state, under one tenant."""

    bucket: datetime
    step_s: int
    tenant_id: str
    subject: str
    kind: Literal["sandbox", "volume"]
    template: str
    state: str  # running | paused | suspended | stored
    figures: Figures


@dataclass(frozen=True)
class TrafficSample:
    bucket: datetime
    step_s: int
    tenant_id: str
    sandbox_id: str
    host: str
    sent: int
    received: int


Grouping = Literal["total", "tenant", "sandbox", "template", "label"]


@dataclass(frozen=True)
class UsageQuery:
    since: datetime
    until: datetime
    step_s: int
    tenant_id: str | None = None  # None: every tenant's (an admin's question)
    by: Grouping = "total"
    label: str | None = None  # the metadata key `by="label"` groups by
    sandbox_id: str | None = None
    template: str | None = None
    metadata: tuple[str, str] | None = None  # only sandboxes whose metadata has this key=value
    limit: int = 10_000  # rows (series by points) at most; one more says there are more


@dataclass(frozen=True)
class UsagePoint:
    key: str | None  # the group (None: the whole, or sandboxes without the label)
    at: datetime
    state: str
    figures: Figures


@dataclass(frozen=True)
class HostTraffic:
    host: str
    sent: int
    received: int


@dataclass(frozen=True)
class Owner:
    """Whose a sandbox is now, for its usage."""

    tenant_id: str
    template: str


@dataclass(frozen=True)
class StateTime:
    """Seconds a sandbox spent in one state, under one tenant, within a span of time, and what
    it was given meanwhile."""

    sandbox_id: str
    tenant_id: str
    template: str
    state: str  # running | paused | suspended
    vcpus: int
    memory_mib: int
    seconds: float


@dataclass(frozen=True)
class Stored:
    """What a sandbox's checkpoints or a volume hold, for as long as they are kept."""

    kind: Literal["sandbox", "volume"]
    subject: str
    tenant_id: str
    template: str
    bytes: int


def _figures(row: sa.Row[Any]) -> Figures:
    # Sums of bigint columns come back as decimals.
    values: dict[str, Any] = {n: KINDS[n](getattr(row, n) or 0) for n in NAMES}
    return Figures(**values)


def _adding(table: sa.Table, statement: sa.dialects.postgresql.Insert, names: Sequence[str]):  # type: ignore[no-untyped-def]
    return {n: table.c[n] + statement.excluded[n] for n in names}


class UsageQueries(Queries):
    async def record_usage(
        self,
        samples: Sequence[UsageSample],
        traffic: Sequence[TrafficSample],
        counted_until: datetime | None = None,
    ) -> None:
        """Add to the buckets and the totals, and move the cursor of time in states to
        `counted_until`, in one transaction: a round is counted once or not at all."""
        async with self.engine.begin() as c:
            if counted_until is not None:
                cursor = insert(t.usage_cursor).values(id=1, until=counted_until)
                moved = cursor.on_conflict_do_update(
                    index_elements=["id"], set_={"until": counted_until}
                )
                await c.execute(moved)
            if samples:
                await _add_usage(c, samples)
                await _add_totals(c, samples)
            rows = _merged([asdict(s) for s in traffic], TRAFFIC_KEY, ("sent", "received"))
            for part in _parts(rows):
                add = insert(t.usage_traffic).values(part)
                await c.execute(
                    add.on_conflict_do_update(
                        index_elements=list(TRAFFIC_KEY),
                        set_=_adding(t.usage_traffic, add, ["sent", "received"]),
                    )
                )

    async def usage_window(self) -> tuple[datetime | None, datetime]:
        """Up to when time in states has been counted (None: never yet), and the database's
        clock now (the clock state changes are recorded by)."""
        async with self.engine.connect() as c:
            row = (await c.execute(sa.select(
                sa.select(t.usage_cursor.c.until).scalar_subquery(), sa.func.clock_timestamp()
            ))).one()  # fmt: skip
        return row[0], row[1]

    async def time_in_states(self, start: datetime, end: datetime) -> list[StateTime]:
        """What each sandbox spent in running, paused and suspended between `start` and
        `end`, from the state changes it recorded (the tenant of a span is the one its change
        was recorded for: a warm-pool member's is the pool's until its claim)."""
        async with self.engine.connect() as c:
            rows = await c.execute(sa.text(_TIME_IN_STATES), {"start": start, "end": end})
        return [StateTime(r.sandbox_id, r.tenant_id, r.template, r.state, r.vcpus, r.memory_mib,
                          float(r.seconds)) for r in rows if r.seconds > 0]  # fmt: skip

    async def owners(self, sandbox_ids: Sequence[str]) -> dict[str, Owner]:
        s = t.sandboxes.c
        found: dict[str, Owner] = {}
        async with self.engine.connect() as c:
            for part in _parts(list(sandbox_ids)):
                q = sa.select(s.id, s.tenant_id, s.template).where(s.id.in_(part))
                found |= {r.id: Owner(r.tenant_id, r.template) for r in await c.execute(q)}
        return found

    async def stored(self) -> list[Stored]:
        """Every sandbox's checkpoints (that are there) and every volume (that is not deleted),
        with the bytes each holds: checkpoints as the worker measured them, volumes as large
        as they were made."""
        k, s, v = t.checkpoints.c, t.sandboxes.c, t.volumes.c
        checkpoints = (
            sa.select(k.sandbox_id, k.tenant_id, s.template, sa.func.sum(k.size_bytes).label("n"))
            .join(t.sandboxes, s.id == k.sandbox_id)
            .where(k.state == "ready")
            .group_by(k.sandbox_id, k.tenant_id, s.template)
        )
        volumes = sa.select(v.id, v.tenant_id, v.size_mib).where(v.state != "deleted")
        async with self.engine.connect() as c:
            kept = (await c.execute(checkpoints)).all()
            made = (await c.execute(volumes)).all()
        return [
            Stored("sandbox", r.sandbox_id, r.tenant_id, r.template, int(r.n)) for r in kept
        ] + [Stored("volume", r.id, r.tenant_id, "", r.size_mib << 20) for r in made]

    async def usage(self, q: UsageQuery) -> list[UsagePoint]:
        """Each group's figures by bucket of `q.step_s` and state, oldest first; at most
        `q.limit` + 1 of them."""
        u, s = t.usage.c, t.sandboxes.c
        # Buckets of every step are counted from the epoch: a day's from midnight UTC.
        step = sa.func.make_interval(0, 0, 0, 0, 0, 0, q.step_s)
        at = sa.func.date_bin(step, u.bucket, sa.func.to_timestamp(0)).label("at")
        key = {
            "total": sa.null(),
            "tenant": u.tenant_id,
            "sandbox": sa.case((u.kind == "sandbox", u.subject)),
            "template": sa.func.nullif(u.template, ""),
            "label": s.metadata[q.label or ""].astext,
        }[q.by].label("key")
        sums = [sa.func.sum(u[n]).label(n) for n in NAMES]
        joined = t.usage.outerjoin(t.sandboxes, sa.and_(u.kind == "sandbox", s.id == u.subject))
        query = (
            sa.select(key, at, u.state, *sums)
            .select_from(joined)
            .where(u.bucket >= q.since, u.bucket < q.until)
            .group_by(sa.literal_column("key"), sa.literal_column("at"), u.state)
            .order_by(sa.literal_column("key").nulls_first(), sa.literal_column("at"), u.state)
            .limit(q.limit + 1)
        )
        query = _filtered(query, q, u.tenant_id, u.subject, u.template, s.metadata)
        if q.sandbox_id is not None or q.metadata is not None:
            query = query.where(u.kind == "sandbox")
        rows = await _bounded(self.engine, query)
        return [UsagePoint(r.key, r.at, r.state, _figures(r)) for r in rows]

    async def usage_hosts(self, q: UsageQuery, limit: int = 100) -> list[HostTraffic]:
        """The hosts most sent to in the range, and what each took and gave."""
        x, s = t.usage_traffic.c, t.sandboxes.c
        sent, received = sa.func.sum(x.sent).label("sent"), sa.func.sum(x.received).label("got")
        query = (
            sa.select(x.host, sent, received)
            .select_from(t.usage_traffic.outerjoin(t.sandboxes, s.id == x.sandbox_id))
            .where(x.bucket >= q.since, x.bucket < q.until)
            .group_by(x.host)
            .order_by(sa.desc("sent"), x.host)
            .limit(limit)
        )
        query = _filtered(query, q, x.tenant_id, x.sandbox_id, s.template, s.metadata)
        rows = await _bounded(self.engine, query)
        return [HostTraffic(r.host, int(r.sent), int(r.got)) for r in rows]

    async def usage_totals(self) -> list[tuple[str, str, Figures]]:
        """(tenant, state, figures since metering began) of every tenant that used anything."""
        async with self.engine.connect() as c:
            rows = (await c.execute(sa.select(t.usage_totals))).all()
        return [(r.tenant_id, r.state, _figures(r)) for r in rows]

    async def roll_up_usage(self, before: datetime) -> int:
        """Buckets finer than an hour that began before `before` become hourly ones (sums kept
        to the byte and the second); how many rows went."""
        async with self.engine.begin() as c:
            gone = await c.execute(
                sa.text(_ROLL_UP.format(
                    table="usage",
                    keys="tenant_id, subject, kind, template, state",
                    conflict="subject, bucket, step_s, state, tenant_id",
                    figures=", ".join(NAMES),
                    sums=", ".join(f"sum({n})" for n in NAMES),
                    adding=", ".join(f"{n} = usage.{n} + excluded.{n}" for n in NAMES),
                )),
                {"before": before, "step": ROLLED_UP_S},
            )  # fmt: skip
            traffic = await c.execute(
                sa.text(_ROLL_UP.format(
                    table="usage_traffic",
                    keys="tenant_id, sandbox_id, host",
                    conflict="sandbox_id, bucket, step_s, host, tenant_id",
                    figures="sent, received",
                    sums="sum(sent), sum(received)",
                    adding="sent = usage_traffic.sent + excluded.sent, "
                    "received = usage_traffic.received + excluded.received",
                )),
                {"before": before, "step": ROLLED_UP_S},
            )  # fmt: skip
            return int(gone.scalar_one()) + int(traffic.scalar_one())


# Each span of a state: from the change that began it (the last one before `start`, or one
# within) to the next change (or `end`), cut to the window. Only sandboxes that could have
# spent time in it: those not deleted, and those that changed since `start`.
_TIME_IN_STATES = """
WITH live AS (
    SELECT id, template, vcpus, memory_mib FROM sandboxes
    WHERE state != 'deleted' OR updated_at >= :start
), marks AS (
    SELECT l.id AS sandbox_id, b.tenant_id, b.to_state AS state, b.id AS event_id, b.at
    FROM live l CROSS JOIN LATERAL (
        SELECT e.tenant_id, e.to_state, e.id, e.at FROM events e
        WHERE e.sandbox_id = l.id AND e.type IN ('created', 'state')
          AND e.to_state IS NOT NULL AND e.at < :start
        ORDER BY e.id DESC LIMIT 1
    ) b
    UNION ALL
    SELECT e.sandbox_id, e.tenant_id, e.to_state, e.id, e.at
    FROM events e JOIN live l ON l.id = e.sandbox_id
    WHERE e.type IN ('created', 'state') AND e.to_state IS NOT NULL
      AND e.at >= :start AND e.at < :end
), spans AS (
    SELECT *, lead(at) OVER (PARTITION BY sandbox_id ORDER BY event_id) AS until FROM marks
)
SELECT s.sandbox_id, s.tenant_id, l.template, s.state, l.vcpus, l.memory_mib,
       sum(extract(epoch FROM least(coalesce(s.until, :end), :end) - greatest(s.at, :start)))
           AS seconds
FROM spans s JOIN live l ON l.id = s.sandbox_id
WHERE s.state IN ('running', 'paused', 'suspended')
GROUP BY s.sandbox_id, s.tenant_id, l.template, s.state, l.vcpus, l.memory_mib
"""


# One statement: the fine rows go and their sums arrive as hourly ones (an hourly bucket's key
# differs from every fine one's by its step, so nothing being deleted conflicts).
_ROLL_UP = """
WITH gone AS (
    DELETE FROM {table} WHERE step_s < :step AND bucket < :before RETURNING *
), added AS (
    INSERT INTO {table} (bucket, step_s, {keys}, {figures})
    SELECT date_trunc('hour', bucket AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', :step, {keys}, {sums}
    FROM gone GROUP BY 1, {keys}
    ON CONFLICT ({conflict}) DO UPDATE SET {adding}
)
SELECT count(*) FROM gone
"""


QUESTION_S = 10  # how long one usage question may take the database


async def _bounded(engine: AsyncEngine, query: sa.Select[Any]) -> list[sa.Row[Any]]:
    """The rows of a caller's question, or Refused (503) if it takes the database too long."""
    async with engine.begin() as c:
        await c.execute(sa.text(f"SET LOCAL statement_timeout = '{QUESTION_S}s'"))
        try:
            return list((await c.execute(query)).all())
        except sa.exc.DBAPIError as e:
            if "statement timeout" not in str(e):
                raise
    raise Refused(503, f"the usage question took more than {QUESTION_S} s: ask for a shorter "
                  "range, a longer step or fewer series")  # fmt: skip


def _filtered(query: sa.Select, q: UsageQuery, tenant, subject, template, metadata):  # type: ignore[no-untyped-def, type-arg]
    if q.tenant_id is not None:
        query = query.where(tenant == q.tenant_id)
    if q.sandbox_id is not None:
        query = query.where(subject == q.sandbox_id)
    if q.template is not None:
        query = query.where(template == q.template)
    if q.metadata is not None:
        query = query.where(metadata[q.metadata[0]].astext == q.metadata[1])
    return query


def _merged(
    rows: list[dict[str, Any]], key: Sequence[str], adding: Sequence[str]
) -> list[dict[str, Any]]:
    """One row per key (one statement may not add to the same row twice)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        k = tuple(row[n] for n in key)
        if k in merged:
            for n in adding:
                merged[k][n] += row[n]
        else:
            merged[k] = dict(row)
    return list(merged.values())


# Rows a statement carries at most: PostgreSQL takes 32767 parameters, a usage row has 19.
PART = 1000


def _parts(rows: list[T]) -> list[list[T]]:
    return [rows[i : i + PART] for i in range(0, len(rows), PART)]


USAGE_KEY = ("subject", "bucket", "step_s", "state", "tenant_id")
TRAFFIC_KEY = ("sandbox_id", "bucket", "step_s", "host", "tenant_id")


async def _add_usage(c: AsyncConnection, samples: Sequence[UsageSample]) -> None:
    rows = [
        {"bucket": s.bucket, "step_s": s.step_s, "tenant_id": s.tenant_id, "subject": s.subject,
         "kind": s.kind, "template": s.template, "state": s.state, **asdict(s.figures)}
        for s in samples
    ]  # fmt: skip
    for part in _parts(_merged(rows, USAGE_KEY, NAMES)):
        add = insert(t.usage).values(part)
        await c.execute(
            add.on_conflict_do_update(
                index_elements=list(USAGE_KEY), set_=_adding(t.usage, add, NAMES)
            )
        )


async def _add_totals(c: AsyncConnection, samples: Sequence[UsageSample]) -> None:
    totals: dict[tuple[str, str], dict[str, float]] = {}
    for s in samples:
        into = totals.setdefault((s.tenant_id, s.state), dict.fromkeys(NAMES, 0))
        for n, v in asdict(s.figures).items():
            into[n] += v
    rows = [{"tenant_id": k[0], "state": k[1], **v} for k, v in sorted(totals.items())]
    for part in _parts(rows):
        add = insert(t.usage_totals).values(part)
        await c.execute(
            add.on_conflict_do_update(
                index_elements=["tenant_id", "state"], set_=_adding(t.usage_totals, add, NAMES)
            )
        )

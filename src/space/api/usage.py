"""`GET /v1/usage`: what sandboxes and volumes were given and used (space.controller.metering
records it), over a range, at a step, as a whole or by tenant, sandbox, template or a metadata
label; `GET /v1/usage/hosts`: the hosts their gateways sent most to. A tenant's key reads its
own usage, an admin key everyone's (or one tenant's)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query

from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.schemas import (
    HostUsage,
    HostUsagePage,
    UsageAnswer,
    UsageFigures,
    UsagePoint,
    UsageSeries,
)
from space.db.store.usage import Figures, UsageQuery
from space.db.store.usage import UsagePoint as Row

router = APIRouter(prefix="/v1/usage", tags=["usage"])

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
STEP = re.compile(r"^([1-9][0-9]{0,7})([smhd]?)$")
BY = re.compile(r"^(total|tenant|sandbox|template|label:[A-Za-z0-9_.:/-]{1,64})$")
LABEL = re.compile(r"^([A-Za-z0-9_.:/-]{1,64})=(.{0,256})$")
MAX_STEPS = 5000  # points of one series
MAX_ROWS = 20_000  # points of all series together (by state)
STATES = ("running", "paused", "suspended")

Step = Annotated[str, Query(max_length=12, description='"3600", "60s", "5m", "1h", "1d"')]
By = Annotated[
    str, Query(max_length=80, description='total, tenant, sandbox, template or "label:KEY"')
]
Label = Annotated[
    str | None, Query(max_length=330, description='only sandboxes with this metadata "KEY=VALUE"')
]
Tenant = Annotated[str | None, Query(max_length=100, description="admins only")]
Sandbox = Annotated[str | None, Query(max_length=100)]
Template = Annotated[str | None, Query(max_length=200)]


def parse_step(step: str) -> int:
    m = STEP.match(step.strip())
    if m is None:
        raise APIError(400, f"step {step!r}: a whole number of seconds, or with s, m, h or d")
    return int(m.group(1)) * UNITS[m.group(2) or "s"]


def _query(
    caller: Caller,
    since: datetime | None,
    until: datetime | None,
    step_s: int,
    tenant: str | None,
    sandbox: str | None,
    template: str | None,
    label: str | None,
    by: str = "total",
) -> UsageQuery:
    if tenant is not None and not caller.admin and tenant != caller.id:
        raise APIError(403, "only an admin key may read another tenant's usage")
    if by == "tenant" and not caller.admin:
        raise APIError(403, "only an admin key may read usage by tenant")
    until = until or datetime.now(UTC)
    since = since or until - timedelta(days=1)
    if since.tzinfo is None or until.tzinfo is None:
        raise APIError(400, "since and until need a time zone (e.g. 2026-12-01T00:00:00Z)")
    if since >= until:
        raise APIError(400, "since must be before until")
    if (until - since).total_seconds() / step_s > MAX_STEPS:
        raise APIError(400, f"more than {MAX_STEPS} steps of {step_s} s from since to until: "
                       "take a longer step or a shorter range")  # fmt: skip
    metadata = None
    if label is not None:
        m = LABEL.match(label)
        if m is None:
            raise APIError(400, f'label {label!r}: "KEY=VALUE", the key of letters, digits, _.:/-')
        metadata = (m.group(1), m.group(2))
    grouping, _, key = by.partition(":")
    return UsageQuery(
        since=since, until=until, step_s=step_s, tenant_id=tenant if caller.admin else caller.id,
        by=grouping, label=key or None, sandbox_id=sandbox,  # type: ignore[arg-type]
        template=template, metadata=metadata, limit=MAX_ROWS,
    )  # fmt: skip


@router.get("", response_model=UsageAnswer)
async def read_usage(
    svc: Svc,
    caller: Caller,
    since: datetime | None = None,
    until: datetime | None = None,
    step: Step = "1h",
    by: By = "total",
    tenant: Tenant = None,
    sandbox: Sandbox = None,
    template: Template = None,
    label: Label = None,
) -> UsageAnswer:
    """From `since` (default: a day before `until`) to `until` (default: now), one point per
    `step` with something in it. Steps are counted from midnight UTC; buckets older than the
    deployment keeps finely (SPACE_USAGE_FINE_DAYS) are hours, so a finer step shows them
    whole in the step they begin in."""
    if BY.match(by) is None:
        raise APIError(400, f'by {by!r}: total, tenant, sandbox, template or "label:KEY"')
    q = _query(caller, since, until, parse_step(step), tenant, sandbox, template, label, by)
    rows = await svc.store.usage(q)
    if len(rows) > MAX_ROWS:
        raise APIError(400, f"more than {MAX_ROWS} points: take a longer step, a shorter range, "
                       "or fewer series (filter by sandbox, template or label)")  # fmt: skip
    series = [
        UsageSeries(key=key, points=points, total=_sum(points))
        for key, points in _series(rows).items()
    ]
    return UsageAnswer(since=q.since, until=q.until, step_s=q.step_s, by=by, series=series,
                       total=_sum(series))  # fmt: skip


@router.get("/hosts", response_model=HostUsagePage)
async def read_hosts(
    svc: Svc,
    caller: Caller,
    since: datetime | None = None,
    until: datetime | None = None,
    tenant: Tenant = None,
    sandbox: Sandbox = None,
    template: Template = None,
    label: Label = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> HostUsagePage:
    """The hosts sandboxes' gateways sent most to, from `since` to `until` (default: the last
    day): bytes sent on to each and received from it."""
    q = _query(caller, since, until, 3600, tenant, sandbox, template, label)
    hosts = await svc.store.usage_hosts(q, limit)
    return HostUsagePage(items=[HostUsage(host=h.host, sent_bytes=h.sent, received_bytes=h.received)
                                for h in hosts])  # fmt: skip


def _figures(state: str, f: Figures) -> dict[str, float]:
    """A state's figures under the API's names (what is given is told apart by state)."""
    named: dict[str, float] = {k: v for k, v in asdict(f).items() if k not in (
        "seconds", "vcpu_seconds", "memory_gib_seconds")}  # fmt: skip
    if state in STATES:
        named[f"{state}_seconds"] = f.seconds
    if state in ("running", "paused"):
        named[f"vcpu_seconds_{state}"] = f.vcpu_seconds
        named[f"memory_gib_seconds_{state}"] = f.memory_gib_seconds
    return named


def _series(rows: list[Row]) -> dict[str | None, list[UsagePoint]]:
    points: dict[str | None, dict[datetime, dict[str, float]]] = defaultdict(dict)
    for row in rows:
        at = points[row.key].setdefault(row.at, defaultdict(float))
        for name, value in _figures(row.state, row.figures).items():
            at[name] += value
    return {
        key: [UsagePoint.model_validate({"at": at, **f}) for at, f in sorted(by_at.items())]
        for key, by_at in points.items()
    }


def _sum(parts: list[UsagePoint] | list[UsageSeries]) -> UsageFigures:
    total: dict[str, float] = defaultdict(float)
    for part in parts:
        figures = part.total if isinstance(part, UsageSeries) else part
        for name in UsageFigures.model_fields:
            total[name] += getattr(figures, name)
    return UsageFigures.model_validate(total)

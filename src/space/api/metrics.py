"""Prometheus metrics of the API process at `/metrics`: creates by path, warm-pool hits and
misses, each pool's state, and each tenant's usage counters (`space_usage_*_total` by tenant
and state, since metering began), the last two read from the database at scrape time.

A scrape must send the deployment's metrics token as a bearer token (SPACE_METRICS_TOKEN, or
one made once in the state directory, which `space up` prints). The figures name templates and
tenants (for billing), never sandboxes.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from space.api.deps import Svc
from space.api.errors import APIError
from space.db.store.usage import NAMES, Figures

router = APIRouter()

CLAIMS = Counter(
    "space_pool_claims_total",
    "Creates that asked the warm pool, by whether it had a member for them",
    ["template", "result"],
)
CREATE = Histogram(
    "space_sandbox_create_seconds",
    "Create calls answered with a running sandbox, by how it came to run",
    ["template", "boot"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.35, 0.5, 1, 2.5, 5, 10, 30),
)
READY = Gauge("space_pool_ready", "Pool members ready to be claimed", ["template"])
STARTING = Gauge("space_pool_starting", "Pool members on their way", ["template"])
SIZE = Gauge("space_pool_size", "Members each pool is asked to keep", ["template"])


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, svc: Svc) -> Response:
    sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(sent.encode(), svc.metrics_token.encode()):
        raise APIError(401, "metrics need 'Authorization: Bearer <metrics token>' (space up "
                       "prints it; SPACE_METRICS_TOKEN sets it)")  # fmt: skip
    for row in await svc.store.templates():
        if row["tenant_id"] is not None:  # a tenant's own: no pool, and ids without bound
            continue
        READY.labels(row["id"]).set(row["pool_ready"])
        STARTING.labels(row["id"]).set(row["pool_starting"])
        SIZE.labels(row["id"]).set(row["pool_size"])
    usage = CollectorRegistry(auto_describe=False)
    usage.register(_Usage(await svc.store.usage_totals()))
    return Response(generate_latest() + generate_latest(usage), media_type=CONTENT_TYPE_LATEST)


class _Usage(Collector):
    """Each tenant's usage totals, as counters by tenant and state."""

    def __init__(self, totals: list[tuple[str, str, Figures]]) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        for name in NAMES:
            family = CounterMetricFamily(
                f"space_usage_{name}",
                f"Usage: {name.replace('_', ' ')}",
                labels=["tenant", "state"],
            )
            for tenant, state, figures in self.totals:
                family.add_metric([tenant, state], getattr(figures, name))
            yield family

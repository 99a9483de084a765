"""Prometheus metrics of the API process at `/metrics`: creates by path, warm-pool hits and
misses, and each pool's state read from the database at scrape time.

Open to anyone who can reach the API unless SPACE_METRICS_TOKEN is set; then a scrape must
send it as a bearer token. The figures name templates, never tenants or sandboxes.
"""

from __future__ import annotations

import hmac
import os

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from space.api.deps import Svc
from space.api.errors import APIError

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
    token = os.environ.get("SPACE_METRICS_TOKEN", "")
    if token:
        sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent.encode(), token.encode()):
            raise APIError(401, "metrics need 'Authorization: Bearer <SPACE_METRICS_TOKEN>'")
    for row in await svc.store.templates():
        READY.labels(row["id"]).set(row["pool_ready"])
        STARTING.labels(row["id"]).set(row["pool_starting"])
        SIZE.labels(row["id"]).set(row["pool_size"])
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

"""The API application and its process (`space api`)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from space import __version__, crashpoints, e2b, tracing
from space.api import (
    audit,
    checkpoints,
    console,
    data,
    errors,
    ingress,
    ingress_ws,
    join,
    me,
    metrics,
    previews,
    processes,
    quotas,
    sandboxes,
    secrets,
    stats,
    templates,
    tenants,
    usage,
    volumes,
    webhooks,
    workers,
)
from space.api.audit_trail import AuditTrail
from space.api.deps import Services
from space.api.limits import BodyLimit, RateLimiter
from space.api.previews import PreviewHosts
from space.db import migrate
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Store, connect
from space.e2b import app as e2b_app
from space.http_server import KEEP_ALIVE_S, Server
from space.identity import WorkerCA
from space.logs import RequestLog
from space.settings import Settings
from space.tracing import Traced
from space.worker.api.client import RESTART_S, WorkerClient

SANDBOX_PATH = re.compile(r"^/v1/sandboxes/([A-Za-z0-9_.-]{1,100})(?:/|$)")
# Probes, scrapes and workers' heartbeats: a line each only at DEBUG.
QUIET = re.compile(r"/healthz|/metrics|/v1/workers/[^/]+/heartbeat")
OPENAPI_FILE = Path(__file__).resolve().parents[3] / "docs" / "openapi.json"


def create_app(settings: Settings, database_url: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        crashpoints.arm(settings.crash_at)
        tracing.start("api", settings.otlp_endpoint)
        store = Store(connect(database_url))
        await migrate.upgrade(store.engine)
        listener = Listener(database_url)
        await listener.start()
        ca = WorkerCA(settings.worker_ca_dir) if settings.worker_ca_dir else None
        worker_secret = settings.load_worker_secret()
        workers = WorkerClient(
            worker_secret, tls=ca.client_context() if ca else None, reconnect_s=RESTART_S
        )
        sealer = Sealer(settings.load_sealing_keys(), reload=settings.load_sealing_keys)
        app.state.services = Services(
            store=store,
            listener=listener,
            workers=workers,
            sealer=sealer,
            settings=settings,
            metrics_token=settings.load_metrics_token(),
            rates=RateLimiter(settings.api.rate_limit, settings.api.rate_burst),
            worker_secret=worker_secret,
            worker_ca=ca,
        )
        try:
            yield
        finally:
            await app.state.services.tunnels.close()
            await workers.close()
            await listener.close()
            await store.close()
            tracing.stop()

    app = FastAPI(
        title="SPACE",
        version=__version__,
        summary="Sandboxed microVMs for AI agents",
        lifespan=lifespan,
        telemetry=tracing.FASTAPI_TELEMETRY,
    )
    errors.install(app)
    app.add_middleware(AuditTrail)  # innermost: it sees a preview host's request as rewritten
    app.add_middleware(BodyLimit)  # before any body is read
    # Outside the body limit, which looks at the path a preview host's request is given.
    app.add_middleware(PreviewHosts, domain=settings.api.preview_domain)
    # Inside the log's middleware, which gives the request its id.
    app.add_middleware(Traced, quiet=QUIET)
    # Outermost: even a refused request has its id and its line.
    app.add_middleware(RequestLog, sandbox_path=SANDBOX_PATH, quiet=QUIET)
    app.include_router(sandboxes.router)
    app.include_router(checkpoints.router)
    app.include_router(stats.router)
    app.include_router(data.router)
    app.include_router(processes.router)
    app.include_router(templates.router)
    app.include_router(volumes.router)
    app.include_router(secrets.router)
    app.include_router(quotas.router)
    app.include_router(me.router)
    app.include_router(tenants.router)
    app.include_router(workers.router)
    app.include_router(join.router)
    app.include_router(ingress.router)
    app.include_router(ingress_ws.router)
    app.include_router(previews.router)
    app.include_router(metrics.router)
    app.include_router(audit.router)
    app.include_router(usage.router)
    app.include_router(webhooks.router)
    app.include_router(console.router)
    app.mount(e2b.PREFIX, e2b_app.create(app.state))

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    return app


def openapi_document() -> str:
    app = create_app(Settings(), "postgresql+asyncpg://unused/unused")
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


async def serve(settings: Settings, database_url: str) -> None:
    config = uvicorn.Config(
        create_app(settings, database_url),
        host=settings.api.host,
        port=settings.api.port,
        log_level="warning",
        log_config=None,  # its lines go through our handler, in our format
        ws="wsproto",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    await Server(config).serve()

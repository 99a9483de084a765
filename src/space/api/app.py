"""The API application and its process (`space api`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from space import __version__
from space.api import (
    data,
    errors,
    ingress,
    metrics,
    sandboxes,
    secrets,
    templates,
    volumes,
)
from space.api.deps import Services
from space.config import sealing_keys
from space.db import migrate
from space.db.listen import Listener
from space.db.sealing import Sealer
from space.db.store import Store, connect
from space.worker.client import WorkerClient

OPENAPI_FILE = Path(__file__).resolve().parents[3] / "docs" / "openapi.json"


def create_app(database_url: str, worker_secret: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = Store(connect(database_url))
        await migrate.upgrade(store.engine)
        listener = Listener(database_url)
        await listener.start()
        workers = WorkerClient(worker_secret)
        sealer = Sealer(sealing_keys(), reload=sealing_keys)
        app.state.services = Services(
            store=store, listener=listener, workers=workers, sealer=sealer
        )
        try:
            yield
        finally:
            await workers.close()
            await listener.close()
            await store.close()

    app = FastAPI(
        title="SPACE",
        version=__version__,
        summary="Sandboxed microVMs for AI agents",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(sandboxes.router)
    app.include_router(data.router)
    app.include_router(templates.router)
    app.include_router(volumes.router)
    app.include_router(secrets.router)
    app.include_router(ingress.router)
    app.include_router(metrics.router)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def openapi_document() -> str:
    app = create_app("postgresql+asyncpg://unused/unused", "unused")
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"


async def serve(database_url: str, worker_secret: str, host: str, port: int) -> None:
    config = uvicorn.Config(
        create_app(database_url, worker_secret),
        host=host,
        port=port,
        log_level="warning",
        ws="wsproto",
        timeout_graceful_shutdown=5,
    )
    await uvicorn.Server(config).serve()

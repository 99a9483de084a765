"""The E2B-compatible surface as one application, mounted by the API at `/e2b`: the REST API
at `/e2b` (E2B_API_URL) and the sandbox daemon at `/e2b/envd` (E2B_SANDBOX_URL)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from space import tracing
from space.api import errors
from space.e2b import ENVD_PATH, PREFIX, forks, metrics, rest, snapshots, templates
from space.e2b.envd import Envd
from space.e2b.envd import files as envd_files


def e2b_error(
    status: int, detail: str, headers: Mapping[str, str] | None = None, **_: Any
) -> JSONResponse:
    """An error as E2B's SDKs parse it: they read `code` and `message` before the status."""
    return JSONResponse({"code": status, "message": detail}, status_code=status, headers=headers)


def create(state: State) -> FastAPI:
    """The surface, sharing the API's state (its services, made at its start)."""
    app = FastAPI(title="SPACE: E2B-compatible API", openapi_url=None, docs_url=None,
                  redoc_url=None, telemetry=tracing.FASTAPI_TELEMETRY)  # fmt: skip
    app.state = state
    errors.install(app, render=e2b_error)
    app.include_router(rest.router)
    app.include_router(forks.router)
    app.include_router(metrics.router)
    app.include_router(snapshots.router)
    app.include_router(templates.router)
    app.include_router(envd_files.router)
    app.mount(ENVD_PATH.removeprefix(PREFIX), Envd(lambda: state.services))
    return app

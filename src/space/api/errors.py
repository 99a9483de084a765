"""Errors as `application/problem+json`: every 4xx says what was wrong; nothing leaks a trace."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from space.db.store import Conflict, NotFound, Refused
from space.problem import problem
from space.worker.api.client import WorkerError

log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self, status: int, detail: str, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers
        self.extra = extra


def worker_status(e: WorkerError) -> int:
    """A worker's answer as ours: its 4xx are the client's problem, the rest is a bad gateway."""
    if e.status in (400, 403, 404, 409, 413, 507):
        return e.status
    if e.status == 503 or (e.status == 0 and e.timed_out):
        return 503
    return 502


def validation_detail(errors: Sequence[Mapping[str, Any]]) -> str:
    """What a validation found wrong, in one line: `where: what; …`."""
    return "; ".join(f"{'.'.join(map(str, x.get('loc', ())))}: {x.get('msg', '')}" for x in errors)


Render = Callable[..., JSONResponse]  # (status, detail, headers=None, **extra) -> the answer


def install(app: FastAPI, render: Render = problem) -> None:
    """Every error as `render` says (by default a problem document; the E2B surface its own)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return render(e.status, e.detail, headers=e.headers, **e.extra)

    @app.exception_handler(NotFound)
    async def not_found(_: Request, e: NotFound) -> JSONResponse:
        return render(404, f"no sandbox {e}")

    @app.exception_handler(Conflict)
    async def conflict(_: Request, e: Conflict) -> JSONResponse:
        return render(409, str(e), state=e.state)

    @app.exception_handler(Refused)
    async def refused(_: Request, e: Refused) -> JSONResponse:
        return render(e.status, str(e))

    @app.exception_handler(WorkerError)
    async def worker_error(_: Request, e: WorkerError) -> JSONResponse:
        return render(worker_status(e), e.detail)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(err.get("loc", ())), "msg": str(err.get("msg", ""))} for err in e.errors()
        ]
        detail = validation_detail(errors)
        return render(422, detail or "invalid request", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return render(e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return render(500, "internal error; it has been logged")

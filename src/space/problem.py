"""Errors over HTTP as `application/problem+json` (RFC 9457), for the API and the workers alike."""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from starlette.responses import JSONResponse

PROBLEM = "application/problem+json"


def problem(
    status: int, detail: str, headers: Mapping[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """A problem answer; `extra` members set to None are left out."""
    body = {
        "type": "about:blank",
        "title": HTTPStatus(status).phrase,
        "status": status,
        "detail": detail,
        **{k: v for k, v in extra.items() if v is not None},
    }
    return JSONResponse(body, status_code=status, media_type=PROBLEM, headers=headers)

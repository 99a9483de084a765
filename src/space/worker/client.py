"""The client of the worker API (docs/worker-api.md), used by the controller and the API server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

STREAM_TIMEOUT = httpx.Timeout(None, connect=5.0)


class WorkerError(Exception):
    """A worker refused or failed a call; `status` is its HTTP status (0: unreachable)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        body = resp.json()
        detail = str(body.get("detail") or body.get("title") or body)
    except ValueError:
        detail = resp.text[:500]
    raise WorkerError(resp.status_code, detail)


class WorkerClient:
    """One shared HTTP client for all workers; lifecycle calls may take as long as a boot."""

    def __init__(self, secret: str, timeout: float = 300.0) -> None:
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=5.0),
            headers={"Authorization": f"Bearer {secret}"},
            limits=httpx.Limits(max_connections=200, max_keepalive_connections=50),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def call(self, method: str, url: str, *, json: Any = None, params: Any = None) -> Any:
        try:
            resp = await self.http.request(method, url, json=json, params=params)
        except httpx.TransportError as e:
            raise WorkerError(0, f"worker at {url} unreachable: {e or type(e).__name__}") from e
        _raise_for(resp)
        return resp.json() if resp.content else None

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        params: Any = None,
        content: Any = None,
    ) -> AsyncIterator[httpx.Response]:
        """A streamed call; a non-2xx answer raises before the body is handed over.

        A stream may rightly stay silent for as long as its process runs, so only connecting
        is bounded, not reading."""
        req = self.http.build_request(
            method, url, json=json, params=params, content=content, timeout=STREAM_TIMEOUT
        )
        try:
            resp = await self.http.send(req, stream=True)
        except httpx.TransportError as e:
            raise WorkerError(0, f"worker at {url} unreachable: {e or type(e).__name__}") from e
        try:
            if not resp.is_success:
                await resp.aread()
                _raise_for(resp)
            yield resp
        finally:
            await resp.aclose()

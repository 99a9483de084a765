"""Request body caps, enforced before anything reads a body (even before the key is checked):
a declared Content-Length over the route's cap is answered 413 at once, and a body sent without
one (chunked) is cut off with 413 as soon as it passes the cap. So no request, with a key or
without, makes the API hold more than the cap in memory."""

from __future__ import annotations

import re
import time

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space.problem import problem
from space.worker.api.models import MAX_CONTEXT_B64

JSON_BODY = 1 << 20  # every JSON body the API takes is far smaller
INGRESS_BODY = 1 << 30  # streamed to the sandbox's service as it arrives
# Streamed through to the sandbox as it arrives (its disk quota bounds it): no cap here.
STREAMED = re.compile(r"^/v1/sandboxes/[^/]+/files$")
INGRESS = re.compile(r"^/v1/sandboxes/[^/]+/ports/")
STDIN_BODY = 16 << 20  # raw input for a running process, in one call
STDIN = re.compile(r"^/v1/sandboxes/[^/]+/processes/[^/]+/stdin$")
BUILDS = re.compile(r"^/v1/templates/[^/]+/builds$")
BUILD_BODY = MAX_CONTEXT_B64 + (3 << 20)  # a build's context, with its spec or Dockerfile
E2B_UPLOAD = re.compile(r"^/e2b/templates/[^/]+/files/[^/]+$")  # a COPY step's files
E2B_UPLOAD_BODY = 64 << 20  # as much as a build's whole context may hold unpacked
E2B_FILES = "/e2b/envd/files"  # a multipart form is spooled to disk before it goes on
E2B_FORM_BODY = 256 << 20  # the SDKs send large and streamed writes raw, which stream through
E2B_INPUT = "/e2b/envd/process.Process/StreamInput"  # a terminal's keys, as long as it lasts


def cap_for(method: str, path: str, form: bool = False) -> int | None:
    """The most bytes of body a request to `path` may carry (`form`: a multipart one); None:
    streamed, not capped."""
    if method == "PUT" and STREAMED.match(path):
        return None
    if method == "POST" and path == E2B_FILES:
        return E2B_FORM_BODY if form else None
    if INGRESS.match(path) or path == E2B_INPUT:
        return INGRESS_BODY
    if STDIN.match(path):
        return STDIN_BODY
    if method == "POST" and BUILDS.match(path):
        return BUILD_BODY
    if method == "PUT" and E2B_UPLOAD.match(path):
        return E2B_UPLOAD_BODY
    return JSON_BODY


class TooLarge(HTTPException):
    """Raised by the body's reader: an HTTPException, so the route's own body parsing passes it
    on as the 413 it is rather than as a body that did not parse."""

    def __init__(self, cap: int) -> None:
        super().__init__(413, f"request body too large: this route takes at most {cap} bytes")


class BodyLimit:
    """Outermost ASGI middleware: every HTTP request's body held to `cap_for` its route."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        form = any(
            k == b"content-type" and v.startswith(b"multipart/") for k, v in scope["headers"]
        )
        cap = cap_for(scope["method"], scope["path"], form)
        if cap is None:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > cap:
            await _too_large(scope, receive, send, cap, f"Content-Length {declared}")
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > cap:
                    raise TooLarge(cap)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except TooLarge:  # raised where no route's handler turned it into its answer
            if not started:
                await _too_large(scope, receive, send, cap, "more than that was sent")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses it before we see it
    return None


async def _too_large(scope: Scope, receive: Receive, send: Send, cap: int, what: str) -> None:
    detail = f"request body too large: {what}; this route takes at most {cap} bytes"
    answer = problem(413, detail, headers={"Connection": "close"})
    await answer(scope, receive, send)


class RateLimiter:
    """A token bucket per tenant, in this process: `rate` requests a second, saved up to
    `burst`. Buckets of tenants that have been quiet long enough to be full again are dropped,
    so memory follows the tenants active in the last `burst / rate` seconds."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant: (tokens, at)

    def take(self, tenant_id: str) -> float:
        """0 if the request may go, else the seconds until it could."""
        if self.rate <= 0:
            return 0.0
        now = time.monotonic()
        tokens, at = self._buckets.get(tenant_id, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens < 1:
            self._buckets[tenant_id] = (tokens, now)
            return (1 - tokens) / self.rate
        self._buckets[tenant_id] = (tokens - 1, now)
        if len(self._buckets) > 10_000:
            self._forget_full(now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        full_after = self.burst / self.rate
        for tenant_id, (_, at) in list(self._buckets.items()):
            if now - at > full_after:
                del self._buckets[tenant_id]

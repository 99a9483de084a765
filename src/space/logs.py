"""The services' logs: text lines (the default) or one JSON object a line (SPACE_LOG_FORMAT=json),
each with the request it serves, so one request can be followed from the API through the
controller to the worker.

What a line is about lives in context variables: the API binds the request id (from the
client's `X-Request-Id`, or a new one), the tenant and the sandbox; it keeps the request id with
the sandbox's row, where the controller picks it up again for the steps it takes; every call to
a worker carries the request id and tenant in headers (`context_headers`), which the worker
binds for the lines it writes while serving the call. Each asyncio task starts with a copy of
its creator's context, so what one request binds never leaks into another.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
TENANT_HEADER = "Space-Tenant"
VALID_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")  # a client's id is kept only if it is sane

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
tenant: ContextVar[str | None] = ContextVar("tenant", default=None)
sandbox: ContextVar[str | None] = ContextVar("sandbox", default=None)
worker: ContextVar[str | None] = ContextVar("worker", default=None)
CONTEXT: dict[str, ContextVar[str | None]] = {
    "request_id": request_id,
    "tenant": tenant,
    "sandbox": sandbox,
    "worker": worker,
}
# LogRecord's own attributes: anything else on a record came from `extra=` and is logged too.
_RECORD_FIELDS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def bind(**values: str | None) -> None:
    """Say what the current task works on (request_id, tenant, sandbox, worker)."""
    for name, value in values.items():
        CONTEXT[name].set(value)


def request_id_from(sent: str | None) -> str:
    """The client's request id if it is a sane one, else a new one."""
    if sent and VALID_ID.match(sent):
        return sent
    return secrets.token_hex(8)


def context_headers() -> dict[str, str]:
    """Headers that carry the current request to another service."""
    headers = {}
    if (rid := request_id.get()) is not None:
        headers[REQUEST_ID_HEADER] = rid
    if (tid := tenant.get()) is not None:
        headers[TENANT_HEADER] = tid
    return headers


def bind_from_headers(headers: Mapping[str, str]) -> None:
    """In a service called by another: carry on the caller's request."""
    bind(request_id=request_id_from(headers.get(REQUEST_ID_HEADER.lower())))
    sent = headers.get(TENANT_HEADER.lower())
    if sent and VALID_ID.match(sent):
        bind(tenant=sent)


def _context() -> dict[str, str | None]:
    return {name: var.get() for name, var in CONTEXT.items()}


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time, level, service, logger, message, the request context
    (null where there is none), any `extra=` fields, and the traceback if there is one."""

    def __init__(self, service: str, static: Mapping[str, str]) -> None:
        super().__init__()
        self.service = service
        self.static = dict(static)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(_context())
        for name, value in self.static.items():
            line[name] = line[name] or value
        line.update(
            {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and k not in line}
        )
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """`LEVEL logger: message`, then the request context that is set, as key=value."""

    def __init__(self, static: Mapping[str, str]) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.static = dict(static)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        context = {**self.static, **{k: v for k, v in _context().items() if v}}
        if context:
            text += " [" + " ".join(f"{k}={v}" for k, v in context.items()) + "]"
        return text


def setup(form: str, level: str, service: str, **static: str) -> None:
    """Every line of this process to stderr in `form` ("text" or "json"); `static` fields
    (the worker's id) go on every line whatever the context says."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JSONFormatter(service, static) if form == "json" else TextFormatter(static)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    if level != "debug":
        # A line for each HTTP call we make (the controller's probes: every second) says
        # nothing the callee's own line does not.
        logging.getLogger("httpx").setLevel(logging.WARNING)


class RequestLog:
    """Outermost ASGI middleware of a service: binds each request's context, answers with its
    request id in `X-Request-Id`, and logs one line per request (INFO; DEBUG for paths that
    `quiet` matches whole), with its path but never its query string (a WebSocket's may hold a
    key).

    `sandbox_path` finds the sandbox a request is about in its path. Only a service called by
    our own services (`trusted`) takes the tenant from a header; the API finds it from the key.
    """

    def __init__(
        self,
        app: ASGIApp,
        sandbox_path: re.Pattern[str],
        trusted: bool = False,
        quiet: re.Pattern[str] | None = None,
    ) -> None:
        self.app = app
        self.sandbox_path = sandbox_path
        self.trusted = trusted
        self.quiet = quiet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path: str = scope["path"]
        found = self.sandbox_path.match(path)
        bind(tenant=None, worker=None, sandbox=found.group(1) if found else None)
        if self.trusted:
            bind_from_headers(headers)
        else:
            bind(request_id=request_id_from(headers.get(REQUEST_ID_HEADER.lower())))
        rid = request_id.get() or ""
        status = 0

        async def answer(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = [(REQUEST_ID_HEADER.lower().encode(), rid.encode())]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            elif message["type"] == "websocket.accept":
                status = 101
            elif message["type"] == "websocket.close" and not status:
                status = int(message.get("code", 1000))
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, answer)
        finally:
            ms = round((time.perf_counter() - started) * 1000, 1)
            method = scope.get("method", "WS")
            quiet = self.quiet is not None and self.quiet.fullmatch(path) is not None
            level = logging.DEBUG if quiet else logging.INFO
            log.log(level, "%s %s %s in %.1f ms", method, path, status or "-", ms,
                    extra={"method": method, "path": path, "status": status, "ms": ms})  # fmt: skip

"""Traces: where a request's time went, across the API, the controller, the workers and their
calls into guests, as OpenTelemetry spans exported by OTLP/HTTP to the collector that
`SPACE_OTLP_ENDPOINT` names (nothing at all when none is set: the API's spans are
no-ops then).

One trace follows a request: `Traced` opens a server span for each HTTP call a service answers,
continuing the caller's trace (W3C `traceparent`); `headers()` carries the current one onward;
a sandbox's row keeps the `traceparent` of the request that asked for its state
(`traceparent()`), so the controller's work on it (`continued`) joins that trace though it runs
later, in another process. Every span carries the request id (`space.request_id`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space import __version__, logs
from space.routes import route_of

if TYPE_CHECKING:
    from fastapi.telemetry import TelemetryConfig

tracer = trace.get_tracer("space", __version__)
# FastAPI's own telemetry, off: `Traced` makes the one span of a request, under our rules (a
# trace of our own at the public edge, the request id, no exception text), and nothing else
# leaves a process unasked (its metrics and logs exporters).
FASTAPI_TELEMETRY: TelemetryConfig = {
    "tracing": False, "metrics": False, "logs": False, "operation_spans": False,
    "auto_configure": False,
}  # fmt: skip
REQUEST_ID = "space.request_id"
SANDBOX_ID = "space.sandbox_id"
EXPORT_TIMEOUT_S = 5
FLUSH_MS = 500  # a span leaves for the collector within this, in batches


def start(service: str, endpoint: str) -> None:
    """Export this process's spans to `endpoint` (OTLP/HTTP), named as `service`."""
    if not endpoint:
        return
    # Imported only where traces go somewhere: the exporter brings protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create(
        {"service.name": f"space-{service}", "service.version": __version__}))  # fmt: skip
    exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces",
                                timeout=EXPORT_TIMEOUT_S)  # fmt: skip
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=FLUSH_MS))
    trace.set_tracer_provider(provider)


def stop() -> None:
    """Send what is left (at exit)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def headers() -> dict[str, str]:
    """The current trace, for a call to another service (its `traceparent` only: nothing a
    client put in baggage goes further)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {"traceparent": carrier["traceparent"]} if "traceparent" in carrier else {}


def traceparent() -> str | None:
    """The current trace, to be kept with what a request asked for."""
    return headers().get("traceparent")


@contextlib.contextmanager
def continued(name: str, parent: str | None, **attributes: Any) -> Iterator[Span]:
    """A span in the trace of `parent` (a kept `traceparent`; None: a trace of its own)."""
    context = propagate.extract({"traceparent": parent}) if parent else None
    with tracer.start_as_current_span(name, context=context, attributes=_clean(attributes),
                                      record_exception=False) as span:  # fmt: skip
        yield span


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Span]:
    """A span inside the current one."""
    return tracer.start_as_current_span(name, attributes=_clean(attributes),
                                        record_exception=False)  # fmt: skip


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("__", "."): v for k, v in attributes.items() if v is not None}


class Traced:
    """ASGI middleware: a server span for each HTTP request, named by the route it took once it
    is known. Inside the request log's middleware, which gives the request its id.

    A service called by our own (`trusted`) continues its caller's trace; the public API
    starts a trace of its own and links the client's, so no client chooses our trace ids or
    whether our work is sampled. Paths `quiet` matches whole (probes, scrapes) have a span only
    when a trusted caller's trace asks for one. Exceptions are not recorded in spans: their
    text may hold what a query was given."""

    def __init__(
        self, app: ASGIApp, quiet: re.Pattern[str] | None = None, trusted: bool = False
    ) -> None:
        self.app = app
        self.quiet = quiet
        self.trusted = trusted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        sent = propagate.extract({"traceparent": carrier.get("traceparent", "")})
        asked = trace.get_current_span(sent).get_span_context()
        if (
            self.quiet
            and self.quiet.fullmatch(scope["path"])
            and not (self.trusted and asked.is_valid)
        ):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        with tracer.start_as_current_span(
            method, context=sent if self.trusted else None, kind=SpanKind.SERVER,
            links=[Link(asked)] if asked.is_valid and not self.trusted else None,
            attributes={"http.request.method": method, "url.path": scope["path"][:200],
                        REQUEST_ID: logs.request_id.get() or ""},
            record_exception=False,
        ) as current:  # fmt: skip

            async def answer(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                    current.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        current.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, answer)
            finally:
                if (route := route_of(scope)) is not None:
                    current.update_name(f"{method} {route}")
                    current.set_attribute("http.route", route)
                if sandbox := logs.sandbox.get():
                    current.set_attribute(SANDBOX_ID, sandbox)

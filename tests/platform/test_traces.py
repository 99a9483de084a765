"""Traces across the services, as an operator's collector gets them (OTLP/HTTP, the tests' own
collector on loopback): one trace per request, from the API's span through the controller's
work on the sandbox and the worker's call to the guest agent, each span with the request id."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from space import tracing

from ..collector import Collector, Span
from ..stack import Platform

pytestmark = pytest.mark.vm


def spans_of(collector: Collector, trace_id: str) -> list[Span]:
    return [s for s in collector.seen() if s.trace_id == trace_id]


def wait_for(collector: Collector, found: Callable[[list[Span]], bool], what: str) -> list[Span]:
    deadline = time.monotonic() + 20  # batches leave every 0.5 s
    while not found(spans := collector.seen()):
        assert time.monotonic() < deadline, (what, sorted({(s.service, s.name) for s in spans}))
        time.sleep(0.2)
    return spans


def api_span(collector: Collector, request_id: str, name: str) -> Span:
    def this(spans: list[Span]) -> bool:
        return any(s.name == name and s.attributes.get(tracing.REQUEST_ID) == request_id
                   for s in spans)  # fmt: skip

    spans = wait_for(collector, this, name)
    (found,) = [s for s in spans if s.name == name
                and s.attributes.get(tracing.REQUEST_ID) == request_id]  # fmt: skip
    assert found.service == "space-api"
    return found


CLIENTS_TRACE = secrets.token_hex(16)  # a trace a client says it is in


def call(c: httpx.Client, method: str, path: str, **kw: object) -> tuple[httpx.Response, str]:
    rid = f"trace-{secrets.token_hex(6)}"
    headers = {"X-Request-Id": rid, "traceparent": f"00-{CLIENTS_TRACE}-{'1' * 16}-00"}
    r = c.request(method, path, headers=headers, **kw)  # type: ignore[arg-type]
    assert r.status_code < 300, r.text
    return r, rid


def test_a_create_is_one_trace_from_the_api_to_the_guest(
    platform: Platform, collector: Collector
) -> None:
    with platform.client() as c:
        made, rid = call(c, "POST", "/v1/sandboxes", json={})
        sid = made.json()["id"]
        root = api_span(collector, rid, "POST /v1/sandboxes")
        # A trace of our own, not the client's (which asked not to be sampled): it is linked.
        assert root.trace_id != CLIENTS_TRACE and root.parent_id == ""

        def whole(spans: list[Span]) -> bool:
            """The controller's span, the worker's server span with the span that called it,
            and its agent call: each comes when it ends, in a batch of its own process (the
            caller's after the worker's)."""
            mine = [s for s in spans if s.trace_id == root.trace_id]
            ids = {s.span_id for s in mine}
            served = [
                s
                for s in mine
                if s.service == "space-worker" and "http.request.method" in s.attributes
            ]
            return (any(s.service == "space-controller" for s in mine)
                    and bool(served) and all(s.parent_id in ids for s in served)
                    and any(s.name.startswith("agent ") for s in mine))  # fmt: skip

        wait_for(collector, whole, "the create's trace through controller, worker and agent")
        mine = spans_of(collector, root.trace_id)
        reconcile = [s for s in mine if s.service == "space-controller"]
        assert reconcile and all(s.attributes[tracing.REQUEST_ID] == rid for s in reconcile)
        assert reconcile[0].parent_id == root.span_id  # later, in another process: its child
        assert reconcile[0].attributes[tracing.SANDBOX_ID] == sid
        # The worker's server span of the call that made the VM (a boot, or a pool's claim).
        worker = [s for s in mine if s.service == "space-worker"
                  and "http.request.method" in s.attributes]  # fmt: skip
        assert worker, sorted((s.service, s.name) for s in mine)
        assert worker[0].attributes[tracing.REQUEST_ID] == rid
        assert {s.parent_id for s in worker} <= {s.span_id for s in mine}

        # A command: the API's span, the worker's, the agent's, one trace.
        _, rid = call(c, "POST", f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
        root = api_span(collector, rid, "POST /v1/sandboxes/{sandbox_id}/exec")
        wait_for(collector, lambda s: any(x.trace_id == root.trace_id and x.name == "agent exec"
                                          for x in s), "the exec's agent span")  # fmt: skip

        # Suspend, resume and fork: each request's trace reaches the worker.
        for verb, body in (("suspend", None), ("resume", None), ("fork", {"count": 1})):
            answer, rid = call(c, "POST", f"/v1/sandboxes/{sid}/{verb}", json=body)
            name = f"POST /v1/sandboxes/{{sandbox_id}}/{verb}"
            root = api_span(collector, rid, name)
            wait_for(collector, lambda s, t=root.trace_id: any(
                x.trace_id == t and x.service == "space-worker" for x in s), name)  # fmt: skip
            if verb == "fork":
                for child in answer.json()["items"]:
                    c.delete(f"/v1/sandboxes/{child['id']}")
        c.delete(f"/v1/sandboxes/{sid}")


def test_without_a_collector_nothing_is_set_up() -> None:
    tracing.start("nowhere", "")
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)
    with tracing.span("unsent") as span:
        assert not span.get_span_context().is_valid  # a no-op: nothing recorded, nothing sent

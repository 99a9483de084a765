"""The control plane's audit trail, as it is written: who changed what, when, from where, and
how it ended (read by `space.api.audit`).

`AuditTrail` (an ASGI middleware) records every call that may change something (POST, PUT,
PATCH, DELETE) on the public API and the E2B surface, with the caller's tenant and key (noted by
`deps.admit`), the route, its path parameters, the id of what it made, the status it answered,
the request id and the peer's address. The entry is written before the answer leaves, so no
client ever holds an answer the trail does not have. Left out: the data plane (commands, files,
processes, ingress: the sandbox's own business, and far too many), workers' heartbeats, calls
refused for their rate (nothing happened), and calls with no valid key that did not succeed
(anyone can make those: the request log has them).
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from space import logs
from space.db.store import AuditEntry, Tenant
from space.routes import route_of

if TYPE_CHECKING:
    from space.api.deps import Services

log = logging.getLogger(__name__)

CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
NOT_AUDITED = re.compile(
    r"/v1/sandboxes/[^/]+/(exec|files|ports|processes)(/.*)?"
    r"|/v1/workers/[^/]+/heartbeat"
    r"|/e2b/envd(/.*)?|/e2b/files(/.*)?"
)
SNIFF_MAX = 64 << 10  # the most of a JSON answer held back to find the id of what it made
CREATED_KEYS = ("id", "sandboxID", "templateID")  # where our answers and E2B's carry it


@dataclass
class _Call:
    caller: Tenant | None = None


_call: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("audit_call", default=None)


def note_caller(tenant: Tenant) -> None:
    """The call being served is `tenant`'s (its key authenticated)."""
    call = _call.get()
    if call is not None:
        call.caller = tenant


class AuditTrail:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or scope["method"] not in CHANGING
            or NOT_AUDITED.fullmatch(path)
        ):
            await self.app(scope, receive, send)
            return
        services: Services = scope["app"].state.services
        call = _Call()
        token = _call.set(call)
        recorded = False
        held: Message | None = None  # an answer's start, held while its body is sniffed
        body = bytearray()

        async def record(status: int, created: str | None = None) -> None:
            nonlocal recorded
            recorded = True
            await _record(services, scope, call.caller, status, created)

        async def answer(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                if message["status"] < 300 and _is_json(message):
                    held = message
                    return
                await record(message["status"])
            elif message["type"] == "http.response.body" and held is not None:
                body.extend(message.get("body", b""))
                more = message.get("more_body", False)
                if more and len(body) <= SNIFF_MAX:
                    return
                await record(held["status"], None if more else _created(body))
                await send(held)
                held = None
                message = {**message, "body": bytes(body)}
            await send(message)

        try:
            await self.app(scope, receive, answer)
        finally:
            _call.reset(token)
            if not recorded:  # it failed before answering, or its client went
                await record(held["status"] if held is not None else 500)


async def _record(
    services: Services, scope: Scope, caller: Tenant | None, status: int, created: str | None
) -> None:
    route = route_of(scope)
    # Without a key, only what worked is recorded (a worker's registration): anyone may send
    # the rest, as fast as they like, and the log keeps all it gets.
    if status == 429 or (caller is None and (status >= 400 or route is None)):
        return
    params = {k: str(v) for k, v in scope.get("path_params", {}).items()}
    client = scope.get("client")
    entry = AuditEntry(
        tenant_id=caller.id if caller else None,
        key_id=caller.key_id if caller else None,
        admin=caller.admin if caller else False,
        method=scope["method"],
        action=f"{scope['method']} {route or scope['path']}",
        path=scope["path"],
        params=params,
        created=created,
        status=status,
        request_id=logs.request_id.get(),
        remote=client[0] if client else None,
    )
    try:
        await services.store.record_audit(entry)
    except Exception:  # the answer still goes: the call has happened
        log.exception("could not record %s (%d) in the audit log", entry.action, status)


def _is_json(start: Message) -> bool:
    for name, value in start.get("headers", []):
        if name.lower() == b"content-type":
            return bool(value.split(b";")[0].strip() == b"application/json")
    return False


def _created(body: bytes | bytearray) -> str | None:
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if isinstance(answer, dict):
        for key in CREATED_KEYS:
            if isinstance(answer.get(key), str):
                return str(answer[key])
    return None

"""Preview hosts: a sandbox's port at an origin of its own, `{port}-{sandbox}.{domain}` on the
API's address, and the signed, expiring links that open one in a browser without a key.

A request whose Host names a preview host is rewritten to the ingress route
(`/v1/sandboxes/{sandbox}/ports/{port}/…`), so nothing else of the API answers there, and a
page a sandbox serves shares no origin with the API, its console or another sandbox. Private
by default: the ingress asks for the API key, or for a link's cookie on that host. A link
carries `?space_link=TOKEN`; the first request trades it for a cookie of that host only (303
to the same URL without it), so what the page then loads carries it too.

A token is sealed with the secrets key (AES-GCM: it cannot be forged, altered or read) and
names the API key that made it (revoking the key ends its links at once), the sandbox, the
port and its end. It never reaches the sandbox: the ingress drops its cookie.
"""

from __future__ import annotations

import math
import re
import time
from datetime import UTC, datetime
from typing import Annotated
from urllib.parse import parse_qsl, urlencode

from fastapi import APIRouter, Path, Request
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from space.api.deps import Caller, Svc, admit, authenticate, bearer
from space.api.errors import APIError
from space.api.grants import Grant
from space.api.schemas import Link, NewLink
from space.db.sealing import Sealer
from space.db.store import Tenant
from space.e2b import ENVD_PATH, ENVD_PORT, tokens
from space.problem import problem

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["ingress"])

LINK_PARAM = "space_link"
COOKIE = "space_link"
PREVIEW = "space.preview"  # in the scope of a request that came to a preview host
INVALID = "this link is not valid for this preview host, or it expired"

Port = Annotated[int, Path(ge=1, le=65535)]
SANDBOX_ID = re.compile("[a-z0-9][a-z0-9-]{0,99}")
PORT = re.compile("[0-9]{1,5}")


class PreviewHosts:
    """ASGI middleware: a request to a preview host goes to its port's ingress route, and a
    link's token in its query is traded for the host's cookie first."""

    def __init__(self, app: ASGIApp, domain: str) -> None:
        self.app = app
        self.host = re.compile(
            rf"(\d{{1,5}})-({SANDBOX_ID.pattern})\.{re.escape(domain)}\.?(?::\d{{1,5}})?"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self._preview(scope) if scope["type"] in ("http", "websocket") else None
        if found is None:
            port_call = _sandbox_port(scope) if scope["type"] == "http" else None
            if port_call is not None:
                scope = _to_port(scope, port_call, ENVD_PATH)
            await self.app(scope, receive, send)
            return
        sandbox_id, port = found
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        if scope["type"] == "websocket":  # a page's WebSocket: the link's cookie came before
            kept = urlencode([(k, v) for k, v in query if k != LINK_PARAM]).encode()
            await self.app({**_to_port(scope, found), "query_string": kept}, receive, send)
            return
        if port == ENVD_PORT:
            await self.app(_to_envd(scope, sandbox_id), receive, send)
            return
        links = [v for k, v in query if k == LINK_PARAM]
        if links:
            rest = urlencode([(k, v) for k, v in query if k != LINK_PARAM])
            sealer: Sealer = scope["app"].state.services.sealer
            answer = _trade(sealer, links[0], sandbox_id, port, scope, rest)
            await answer(scope, receive, send)
            return
        await self.app(_to_port(scope, found), receive, send)

    def _preview(self, scope: Scope) -> tuple[str, int] | None:
        host = next((v for k, v in scope["headers"] if k == b"host"), b"")
        found = self.host.fullmatch(host.decode("latin-1").lower())
        if found is None or not 1 <= int(found[1]) <= 65535:
            return None
        return found[2], int(found[1])


def _to_port(scope: Scope, found: tuple[str, int], strip: str = "") -> Scope:
    """The request, addressed to the ingress route of that port of that sandbox (less the
    `strip` its path began with)."""
    prefix = f"/v1/sandboxes/{found[0]}/ports/{found[1]}"
    path = scope["path"].removeprefix(strip)
    raw = (scope.get("raw_path") or scope["path"].encode()).removeprefix(strip.encode())
    return {**scope, "path": prefix + path, "raw_path": prefix.encode() + raw, PREVIEW: found}


def _sandbox_port(scope: Scope) -> tuple[str, int] | None:
    """E2B's SDKs send what is for a sandbox's port (the code interpreter's, …) to the daemon's
    URL (E2B_SANDBOX_URL), naming the sandbox and the port in headers: (sandbox, port) of such
    a call, None for any other."""
    if not scope["path"].startswith(ENVD_PATH + "/"):
        return None
    headers = dict(scope["headers"])
    port = headers.get(b"e2b-sandbox-port", b"").decode("latin-1")
    sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
    if not (PORT.fullmatch(port) and 1 <= int(port) <= 65535 and int(port) != ENVD_PORT):
        return None
    if not SANDBOX_ID.fullmatch(sandbox_id):
        return None
    return sandbox_id, int(port)


def _to_envd(scope: Scope, sandbox_id: str) -> Scope:
    """E2B's SDKs reach a sandbox's daemon at its host name; the API answers for it (by the
    E2B access token the call carries, as on the API's own address)."""
    raw = scope.get("raw_path") or scope["path"].encode()
    headers = [(k, v) for k, v in scope["headers"] if k != b"e2b-sandbox-id"]
    headers.append((b"e2b-sandbox-id", sandbox_id.encode()))
    return {**scope, "path": ENVD_PATH + scope["path"], "raw_path": ENVD_PATH.encode() + raw,
            "headers": headers}  # fmt: skip


def _granted(sealer: Sealer, token: str, sandbox_id: str, port: int) -> Grant | None:
    """The token's grant if it opens this port of this sandbox now."""
    grant = Grant.open(sealer, token)
    return grant if grant is not None and grant.opens(sandbox_id, port) else None


def _trade(
    sealer: Sealer, token: str, sandbox_id: str, port: int, scope: Scope, rest: str
) -> Response:
    grant = _granted(sealer, token, sandbox_id, port)
    if grant is None:
        return problem(401, INVALID)
    # Its own path only: "//elsewhere" (or "/\\elsewhere", which browsers read alike) would
    # be a redirect to another site.
    raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    path = "/" + raw.lstrip("/\\")
    response = Response(status_code=303, headers={"Location": path + (rest and f"?{rest}")})
    response.set_cookie(
        COOKIE, token, max_age=max(1, grant.expires - int(time.time())), path="/",
        secure=scope["scheme"] == "https", httponly=True, samesite="lax",
    )  # fmt: skip
    return response


async def ingress_caller(sandbox_id: str, port: Port, request: HTTPConnection, svc: Svc) -> Tenant:
    """The caller of an ingress request: by its API key, or on a preview host by the cookie
    of a link to this very port of this sandbox, made by a key that is still active."""
    key = bearer(request.headers.get("authorization"))
    if key or PREVIEW not in request.scope:
        return await authenticate(svc, key)
    traffic = request.headers.get(tokens.TRAFFIC_HEADER)
    if traffic is not None:  # E2B's SDKs, to a sandbox's port
        return await tokens.holder(svc, traffic, sandbox_id, tokens.TRAFFIC, port)
    token = request.cookies.get(COOKIE)
    if token is None:
        raise APIError(401, "a preview host needs 'Authorization: Bearer <key>' or a link "
                            "(POST /v1/sandboxes/{id}/links)")  # fmt: skip
    grant = _granted(svc.sealer, token, sandbox_id, port)
    if grant is None:
        raise APIError(401, INVALID)
    tenant = await svc.store.tenant_of_key(grant.key_id)
    if tenant is None:
        raise APIError(401, "the key that made this link was revoked")
    return admit(svc, tenant)


def without_link(cookie: str) -> str:
    """A Cookie header without the link's cookie, which is ours and not the service's."""
    kept = [c for c in cookie.split(";") if c.strip().partition("=")[0] != COOKIE]
    return ";".join(kept).strip()


@router.post("/links", response_model=Link, status_code=201)
async def create_link(
    sandbox_id: str, body: NewLink, request: Request, svc: Svc, caller: Caller
) -> Link:
    """A link that opens the port at its preview host, in a browser and without a key, until
    it expires or the key making this call is revoked; whoever holds it can use it."""
    await svc.store.get_sandbox(sandbox_id, caller.id)  # 404 for anyone else's
    if caller.key_id is None:
        raise APIError(403, "only a call made with an API key can sign a link")
    # Rounded up to the second: a link lasts at least as long as asked, never a moment less.
    grant = Grant(caller.key_id, sandbox_id, body.port, math.ceil(time.time() + body.expires_in_s))
    host = f"{body.port}-{sandbox_id}.{svc.settings.api.preview_domain}"
    if request.url.port is not None:
        host += f":{request.url.port}"
    url = f"{request.url.scheme}://{host}/?{LINK_PARAM}={grant.seal(svc.sealer)}"
    return Link(url=url, port=body.port, expires_at=datetime.fromtimestamp(grant.expires, UTC))

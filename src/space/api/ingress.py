"""Ingress: HTTP to a port a sandbox listens on, through the API and nothing else.

Sandboxes accept no inbound connection at all (their namespace drops it); this route is the one
way in, authenticated like every call (or, at a preview host, by a link: `previews`). The API
opens a TCP connection to 127.0.0.1:PORT inside the guest through its worker and its agent
(`WorkerClient.tcp`), writes the request there and streams both ways: the request's body as it
arrives (up to the route's cap, `limits`), the answer as the service sends it, whatever its
size, with backpressure end to end. Connections are kept alive between requests to the same
port (`ingress_tunnels`); heads are parsed and written by h11, so what reaches the service is a
request the API checked.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Annotated
from urllib.parse import quote, unquote

import h11
from fastapi import APIRouter, Depends, Request, Response
from starlette.requests import HTTPConnection

from space.api.data import ClosingStream, target
from space.api.deps import Svc
from space.api.ingress_tunnels import exchange
from space.api.previews import Port, ingress_caller, without_link
from space.client._calls import INGRESS_VIA
from space.db.store import Tenant

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["ingress"])

HEAD_TIMEOUT_S = 60.0  # for the service's answer to begin
# Not passed on: hop-by-hop headers, framing (h11 frames what it sends; the answer's length is
# kept where the service said it), our own credentials.
DROP_IN = {"host", "authorization", "cookie", "connection", "keep-alive", "transfer-encoding",
           "content-length", "te", "upgrade", "proxy-authorization", "proxy-connection",
           "trailer", "x-api-key", "x-access-token", "e2b-traffic-access-token", "e2b-sandbox-id",
           "e2b-sandbox-port"}  # fmt: skip
DROP_OUT = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"upgrade",
            b"proxy-connection"}  # fmt: skip


async def ingress(
    sandbox_id: str,
    port: Port,
    path: str,
    request: Request,
    svc: Svc,
    caller: Annotated[Tenant, Depends(ingress_caller)],
) -> Response:
    """Forward the request to 127.0.0.1:PORT inside the sandbox and stream its answer back
    (502 when nothing listens there, 504 when nothing answers in time)."""
    worker = await target(svc, caller.id, sandbox_id)
    connect = functools.partial(svc.workers.tcp, worker, sandbox_id, port)
    key = (f"{worker.id} {worker.url}", sandbox_id, port)
    sent, answer = await exchange(svc.tunnels, key, connect, request,
                                  _request(request, port, path), HEAD_TIMEOUT_S)  # fmt: skip

    async def body() -> AsyncIterator[bytes]:
        while (chunk := await sent.chunks.get()) is not None:
            yield chunk

    # Stopped however the answer ends: also when the client left before its first byte (then
    # `body` never starts), or the tunnel would wait on a full queue for ever.
    stack = AsyncExitStack()
    stack.push_async_callback(sent.stop)
    response = ClosingStream(body(), None, stack)
    response.status_code = answer.status_code
    # h11 parsed the answer by its Content-Length (never with Transfer-Encoding): the client gets
    # that many bytes, and a download its size, or a cut connection if the service's ends early.
    response.raw_headers = [(k.lower(), v) for k, v in answer.headers
                            if k.lower() not in DROP_OUT]  # fmt: skip
    response.raw_headers.append((b"via", INGRESS_VIA.encode()))
    return response


def service_target(request: HTTPConnection, path: str) -> str:
    """The request target for the service: its path as the client wrote it (`%2F`, `%3F` and
    `%20` stay as they were), after the ingress route's prefix, and the query."""
    decoded = request.scope["path"]
    slashes = decoded[: len(decoded) - len(path)].count("/")  # the prefix's, up to `path`
    raw = (request.scope.get("raw_path") or b"").split(b"/", slashes)
    if len(raw) > slashes and unquote(rest := raw[-1].decode("latin-1")) == path:
        target_ = "/" + rest
    else:  # a prefix written oddly (encoded): the decoded path, encoded again
        target_ = quote("/" + path)
    query = request.scope.get("query_string", b"").decode("latin-1")
    return target_ + (f"?{query}" if query else "")


def _request(request: Request, port: int, path: str) -> h11.Request:
    target_ = service_target(request, path)
    headers = [("Host", f"localhost:{port}")]
    headers += [(k, v) for k, v in request.headers.items() if k.lower() not in DROP_IN]
    if cookie := without_link(request.headers.get("cookie", "")):
        headers.append(("Cookie", cookie))
    length = request.headers.get("content-length")
    if length is not None:
        headers.append(("Content-Length", length))
    elif "transfer-encoding" in request.headers:
        headers.append(("Transfer-Encoding", "chunked"))
    return h11.Request(method=request.method, target=target_, headers=headers)


for _method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
    router.add_api_route(
        "/ports/{port}/{path:path}", ingress, methods=[_method], response_class=Response,
        operation_id=f"ingress_{_method.lower()}", summary=f"{_method} to a sandbox's port",
    )  # fmt: skip

"""Ingress: HTTP to a port a sandbox listens on, through the API and nothing else.

Sandboxes accept no inbound connection at all (their namespace drops it); this route is the one
way in, authenticated like every call (or, at a preview host, by a link: `previews`). The API
opens a TCP connection to 127.0.0.1:PORT inside the guest through its worker and its agent
(`WorkerClient.tcp`), writes the request there and streams both ways: the request's body as it
arrives (up to the route's cap, `limits`), the answer as the service sends it, whatever its
size, with backpressure end to end. One request per connection (HTTP/1.1 with
`Connection: close`); heads are parsed and written by h11, so what
reaches the service is a request the API checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Annotated
from urllib.parse import quote, unquote

import h11
import httpx
import wsproto.events as wse
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from httpx_ws import AsyncWebSocketSession, HTTPXWSException
from httpx_ws import WebSocketDisconnect as UpstreamDisconnect
from starlette.requests import ClientDisconnect, HTTPConnection

from space.api.data import target
from space.api.deps import Svc
from space.api.errors import APIError
from space.api.previews import Port, ingress_caller, without_link
from space.client._calls import INGRESS_VIA
from space.db.store import Tenant
from space.worker.api.models import TCP_FRAME

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


class Closed(Exception):
    """The connection to the service ended: `status` for the client if no answer had begun."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


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
    head: asyncio.Future[h11.Response] = asyncio.get_running_loop().create_future()
    # A few chunks in flight: a slow client slows the service down (the agent's windows do
    # the rest), nothing piles up here.
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
    # One task owns the connection from start to end (its WebSocket cannot change tasks).
    relay = asyncio.ensure_future(
        _relay(svc.workers.tcp(worker, sandbox_id, port), request, port, path, head, chunks)
    )
    try:
        answer = await asyncio.wait_for(asyncio.shield(head), HEAD_TIMEOUT_S)
    except TimeoutError:
        await _stop(relay)
        why = f"port {port} in the sandbox did not answer in {HEAD_TIMEOUT_S:.0f} s"
        raise APIError(504, why) from None
    except BaseException:
        await _stop(relay)
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
        finally:
            await _stop(relay)

    response = StreamingResponse(body(), status_code=answer.status_code)
    # h11 parsed the answer by its Content-Length (never with Transfer-Encoding): the client gets
    # that many bytes, and a download its size, or a cut connection if the service's ends early.
    response.raw_headers = [(k.lower(), v) for k, v in answer.headers
                            if k.lower() not in DROP_OUT]  # fmt: skip
    response.raw_headers.append((b"via", INGRESS_VIA.encode()))
    return response


async def _relay(
    connect: AbstractAsyncContextManager[AsyncWebSocketSession],
    request: Request,
    port: int,
    path: str,
    head: asyncio.Future[h11.Response],
    chunks: asyncio.Queue[bytes | None],
) -> None:
    """The request out and the answer back: its head to `head` (or the APIError that there is
    none), then its body into `chunks`, None at its end (also where it broke off)."""
    cancelled = False
    try:
        async with connect as ws:
            try:
                conn = h11.Connection(h11.CLIENT)
                await _send(ws, conn, _request(request, port, path))
                relay = asyncio.current_task()
                assert relay is not None
                gone = functools.partial(_cancel_once, relay)
                sending = asyncio.ensure_future(_send_body(ws, conn, request, gone))
                try:
                    async for event in _events(ws, conn):
                        if isinstance(event, h11.Response):
                            head.set_result(event)
                        elif isinstance(event, h11.Data):
                            await chunks.put(bytes(event.data))
                finally:
                    await _stop(sending)
                if not head.done():
                    raise Closed(502, "the connection ended before an answer")
            finally:
                await close_tunnel(ws)
    except Closed as e:
        _fail(head, APIError(e.status, f"port {port} in the sandbox: {e}"))
    except (UpstreamDisconnect, HTTPXWSException) as e:
        _fail(head, APIError(502, f"port {port} in the sandbox: {_why(e)}"))
    except (OSError, httpx.HTTPError) as e:  # the worker itself out of reach
        _fail(head, APIError(503, f"the sandbox's worker did not answer: {e}"))
    except asyncio.CancelledError:  # the client went away: nobody waits for more
        cancelled = True
        _fail(head, APIError(502, "the client went away before an answer"))
        raise
    finally:
        # The answer's end (also where it broke off), once it began. After a cancel its
        # reader may be gone with the queue full: then only for one still waiting on it.
        if head.done() and cancelled:
            with contextlib.suppress(asyncio.QueueFull):
                chunks.put_nowait(None)
        elif head.done():
            await chunks.put(None)


def _fail(head: asyncio.Future[h11.Response], error: APIError) -> None:
    if not head.done():
        head.set_exception(error)


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
    headers = [("Host", f"localhost:{port}"), ("Connection", "close")]
    headers += [(k, v) for k, v in request.headers.items() if k.lower() not in DROP_IN]
    if cookie := without_link(request.headers.get("cookie", "")):
        headers.append(("Cookie", cookie))
    length = request.headers.get("content-length")
    if length is not None:
        headers.append(("Content-Length", length))
    elif "transfer-encoding" in request.headers:
        headers.append(("Transfer-Encoding", "chunked"))
    return h11.Request(method=request.method, target=target_, headers=headers)


async def _send(ws: AsyncWebSocketSession, conn: h11.Connection, event: h11.Event) -> None:
    await write_tcp(ws, conn.send(event) or b"")


async def write_tcp(ws: AsyncWebSocketSession, data: bytes) -> None:
    """Bytes to the service, in frames the worker takes."""
    for i in range(0, len(data), TCP_FRAME):
        await ws.send_bytes(data[i : i + TCP_FRAME])


async def _send_body(
    ws: AsyncWebSocketSession, conn: h11.Connection, request: Request, gone: Callable[[], object]
) -> None:
    """The client's body, as it arrives; then `gone()` once the client hangs up, so a service
    that is quiet for a while (a long computation) learns at once that nobody waits for it.
    Our side of the connection stays open meanwhile: the request is framed, and servers that
    take a half-close for a hang-up (tornado, Node's by default) would drop it unanswered."""
    try:
        async for chunk in request.stream():
            if chunk:
                await _send(ws, conn, h11.Data(data=chunk))
        await _send(ws, conn, h11.EndOfMessage())
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except ClientDisconnect:  # gone in the middle of its body
        pass
    gone()


async def _events(
    ws: AsyncWebSocketSession, conn: h11.Connection
) -> AsyncGenerator[h11.Event, None]:
    """The service's answer: its h11.Response first, then h11.Data until it ends."""
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise Closed(502, f"the service in the sandbox did not answer with HTTP: {e}") from None
        if event is h11.NEED_DATA:
            conn.receive_data(await receive_tcp(ws))
            continue
        if isinstance(event, (h11.Response, h11.Data)):
            yield event
        elif not isinstance(event, h11.InformationalResponse):
            return  # EndOfMessage, or the connection's end


async def receive_tcp(ws: AsyncWebSocketSession) -> bytes:
    """The next bytes from the service; b"" once it closed its side."""
    while True:
        message = await ws.receive()
        if isinstance(message, wse.BytesMessage):
            return bytes(message.data)
        if isinstance(message, wse.CloseConnection):
            if message.code >= 4000:
                raise Closed(message.code - 4000 if message.code < 4600 else 502,
                             message.reason or "the connection failed")  # fmt: skip
            return b""


def _why(e: BaseException) -> str:
    if isinstance(e, UpstreamDisconnect):
        return e.reason or f"closed ({e.code})"
    return str(e) or type(e).__name__


async def _stop(task: asyncio.Task[None]) -> None:
    _cancel_once(task)
    with contextlib.suppress(asyncio.CancelledError, UpstreamDisconnect, HTTPXWSException):
        await task


_closing: set[asyncio.Task[None]] = set()


async def close_tunnel(ws: AsyncWebSocketSession) -> None:
    """Close the tunnel in a task of its own: in the relay's task, the cancel that ends it (its
    client left) cuts the close short, and the worker (so the service) would learn of it only
    when its pings went unanswered, ~40 s later."""
    closing = asyncio.ensure_future(ws.close())
    _closing.add(closing)
    closing.add_done_callback(_closing.discard)
    with contextlib.suppress(UpstreamDisconnect, HTTPXWSException, OSError, httpx.HTTPError):
        await asyncio.shield(closing)


def _cancel_once(task: asyncio.Task[None]) -> None:
    """Cancel the task unless it is already being cancelled."""
    if not task.done() and not task.cancelling():
        task.cancel()


for _method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
    router.add_api_route(
        "/ports/{port}/{path:path}", ingress, methods=[_method], response_class=Response,
        operation_id=f"ingress_{_method.lower()}", summary=f"{_method} to a sandbox's port",
    )  # fmt: skip

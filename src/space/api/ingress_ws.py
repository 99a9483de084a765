"""Ingress for WebSockets: a client's WebSocket to a port a sandbox listens on, through the API.

The API ends the client's WebSocket and opens one of its own to the service, over a TCP
connection inside the guest (the same tunnel as `ingress`, through the worker and the agent):
the handshake is written by wsproto with the client's path, query, subprotocols and headers
(less hop-by-hop ones and our credentials), the service's choice of subprotocol goes back to
the client, and then messages flow both ways as they come, each at most `MAX_MESSAGE`. A
service that refuses the handshake is answered to the client with its status where the server
can send one (else the close code 4000 + status). Authentication is the ingress's: the API
key, or at a preview host a link's cookie or E2B's traffic token.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Annotated

import httpx
import wsproto
import wsproto.events as wse
from fastapi import APIRouter, Path, WebSocket, WebSocketDisconnect
from httpx_ws import AsyncWebSocketSession, HTTPXWSException
from httpx_ws import WebSocketDisconnect as UpstreamDisconnect
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocketState
from wsproto.connection import ConnectionType

from space.api.data import target, until_first
from space.api.deps import Services
from space.api.errors import APIError
from space.api.ingress import DROP_IN, HEAD_TIMEOUT_S, service_target
from space.api.ingress_tunnels import Closed, receive_tcp, write_tcp
from space.api.previews import PREVIEW, ingress_caller, without_link
from space.db.store import NotFound

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["ingress"])

MAX_MESSAGE = 16 << 20
# The handshake's own headers: wsproto writes them for the connection to the service.
HANDSHAKE = {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
             "sec-websocket-protocol"}  # fmt: skip


@router.websocket("/ports/{port}/{path:path}")
async def ingress_ws(
    websocket: WebSocket,
    sandbox_id: str,
    port: Annotated[int, Path(ge=1, le=65535)],
    path: str,
) -> None:
    """A WebSocket to 127.0.0.1:PORT inside the sandbox, relayed message by message."""
    svc: Services = websocket.app.state.services
    if not _same_origin(websocket):
        await _refuse(websocket, 403, "a preview host takes WebSockets from its own pages only")
        return
    try:
        caller = await ingress_caller(sandbox_id, port, websocket, svc)
        worker = await target(svc, caller.id, sandbox_id)
    except NotFound as e:
        await _refuse(websocket, 404, f"sandbox {e} not found")
        return
    except APIError as e:
        await _refuse(websocket, e.status, e.detail)
        return
    try:
        async with svc.workers.tcp(worker, sandbox_id, port) as tunnel:
            conn = wsproto.WSConnection(ConnectionType.CLIENT)
            try:
                accepted = await asyncio.wait_for(
                    _handshake(tunnel, conn, websocket, port, path), HEAD_TIMEOUT_S
                )
            except TimeoutError:
                why = f"port {port} in the sandbox did not answer in {HEAD_TIMEOUT_S:.0f} s"
                await _refuse(websocket, 504, why)
                return
            except Closed as e:
                await _refuse(websocket, e.status, f"port {port} in the sandbox: {e}")
                return
            await websocket.accept(subprotocol=accepted.subprotocol)
            await _pump(websocket, tunnel, conn)
    except (UpstreamDisconnect, HTTPXWSException, OSError, httpx.HTTPError, Closed) as e:
        if websocket.client_state == WebSocketState.CONNECTING:
            await _refuse(websocket, 502, f"port {port} in the sandbox: {e}")
        with contextlib.suppress(RuntimeError, WebSocketDisconnect):
            await websocket.close(code=1011, reason="the connection to the service failed")
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):  # the client may be gone
        await websocket.close()


def _same_origin(websocket: WebSocket) -> bool:
    """At a preview host, where a link's cookie may be what lets the caller in, a browser's
    WebSocket must come from a page of that host: the cookie goes along with WebSockets that
    pages of other preview hosts (the same site) open, and WebSockets know no CORS."""
    origin = websocket.headers.get("origin")
    if PREVIEW not in websocket.scope or origin is None:
        return True
    host = websocket.headers.get("host", "")
    return origin.lower() in (f"http://{host}".lower(), f"https://{host}".lower())


async def _handshake(
    tunnel: AsyncWebSocketSession,
    conn: wsproto.WSConnection,
    websocket: WebSocket,
    port: int,
    path: str,
) -> wse.AcceptConnection:
    """The service's acceptance of the client's handshake, as we pass it on."""
    # The server takes the offer out of the headers (ASGI hands it over on its own).
    offered = [str(p) for p in websocket.scope.get("subprotocols", [])]
    headers = [(k.encode("latin-1"), v.encode("latin-1"))
               for k, v in websocket.headers.items()
               if k.lower() not in DROP_IN | HANDSHAKE]  # fmt: skip
    if cookie := without_link(websocket.headers.get("cookie", "")):
        headers.append((b"cookie", cookie.encode("latin-1")))
    request = wse.Request(
        host=f"localhost:{port}",
        target=service_target(websocket, path),
        subprotocols=offered,
        extra_headers=headers,
    )
    await write_tcp(tunnel, conn.send(request))
    while True:
        data = await receive_tcp(tunnel)
        if not data:
            raise Closed(502, "the connection ended before an answer to the WebSocket handshake")
        try:
            conn.receive_data(data)
            for event in conn.events():
                if isinstance(event, wse.AcceptConnection):
                    return event
                if isinstance(event, wse.RejectConnection):
                    raise Closed(event.status_code, "the service refused the WebSocket")
        except wsproto.utilities.RemoteProtocolError as e:
            raise Closed(502, f"the service did not answer as a WebSocket: {e}") from None


async def _pump(
    client: WebSocket, tunnel: AsyncWebSocketSession, conn: wsproto.WSConnection
) -> None:
    """Messages both ways until either side closes; the other side is then closed too."""
    writing = asyncio.Lock()  # a Pong or a Close must not land inside a message's frames

    async def write(data: bytes) -> None:
        async with writing:
            await write_tcp(tunnel, data)

    async def to_service() -> None:
        while True:
            msg = await client.receive()
            if msg["type"] == "websocket.disconnect":
                code = msg.get("code", 1000)
                await write(conn.send(wse.CloseConnection(code=_closable(code))))
                return
            if msg.get("bytes") is not None:
                await write(conn.send(wse.Message(data=msg["bytes"])))
            elif msg.get("text") is not None:
                await write(conn.send(wse.Message(data=msg["text"])))

    async def to_client() -> None:
        parts: list[bytes | str] = []
        size = 0
        while True:
            data = await receive_tcp(tunnel)
            conn.receive_data(data or None)
            for event in conn.events():
                if isinstance(event, wse.Message):
                    parts.append(event.data)
                    size += len(event.data.encode() if isinstance(event.data, str) else event.data)
                    if size > MAX_MESSAGE:
                        await client.close(code=1009, reason="message too big")
                        return
                    if event.message_finished:
                        await _deliver(client, parts)
                        parts, size = [], 0
                elif isinstance(event, wse.Ping):
                    await write(conn.send(event.response()))
                elif isinstance(event, wse.CloseConnection) and event.code == 1006:
                    await client.close(code=1011, reason="the service went away")
                    return
                elif isinstance(event, wse.CloseConnection):
                    with contextlib.suppress(wsproto.utilities.LocalProtocolError):
                        await write(conn.send(event.response()))
                    await client.close(code=_closable(event.code), reason=event.reason or "")
                    return
            if not data:  # the service's connection ended without a close
                await client.close(code=1011, reason="the service went away")
                return

    await until_first(to_service(), to_client(), quiet=(
        UpstreamDisconnect, WebSocketDisconnect, HTTPXWSException, RuntimeError, Closed,
        wsproto.utilities.LocalProtocolError))  # fmt: skip


async def _deliver(client: WebSocket, parts: list[bytes | str]) -> None:
    if isinstance(parts[0], str):
        await client.send_text("".join(p for p in parts if isinstance(p, str)))
    else:
        await client.send_bytes(b"".join(p for p in parts if isinstance(p, bytes)))


def _closable(code: int | None) -> int:
    """A close code one may send (1005, 1006 and 1015 only report what happened)."""
    return 1000 if code is None or code in (1005, 1006, 1015) else code


async def _refuse(websocket: WebSocket, status: int, why: str) -> None:
    """Before the client's WebSocket is accepted: an HTTP answer with the status where the
    server can send one, else a close with 4000 + status."""
    with contextlib.suppress(RuntimeError, WebSocketDisconnect):
        if "websocket.http.response" in websocket.scope.get("extensions", {}):
            await websocket.send_denial_response(PlainTextResponse(why, status_code=status))
        else:
            await websocket.close(code=4000 + status, reason=why[:120])

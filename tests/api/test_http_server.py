"""The HTTP server every service runs answers, as it stops, what was sent before the stop."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from space.http_server import Server


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def _read_all(conn: socket.socket) -> bytes:
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    return answer


async def test_a_connection_queued_but_not_accepted_when_the_stop_begins_is_answered() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    config = uvicorn.Config(_hello, lifespan="off", log_config=None)
    config.load()
    server = Server(config)
    server.lifespan = config.lifespan_class(config)  # as serve() makes it
    await server.startup(sockets=[listener])
    # The event loop does not run between the connect and the stop, so the connection is still
    # in the listener's queue when the stop begins: the kernel completed it, nobody accepted it.
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    stop = asyncio.ensure_future(server.shutdown(sockets=[listener]))
    try:
        answer = await asyncio.to_thread(_read_all, conn)
    finally:
        conn.close()
        await stop
    assert answer.startswith(b"HTTP/1.1 200") and b"\r\nhello\r\n" in answer, answer
    refused = socket.socket()
    try:
        assert refused.connect_ex(("127.0.0.1", port)) != 0  # and nothing new is taken
    finally:
        refused.close()

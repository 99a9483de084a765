"""The HTTP server every service runs answers, as it stops, what was sent before the stop."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
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


async def _serving(app: Any) -> tuple[Server, socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    server = Server(config)
    server.lifespan = config.lifespan_class(config)  # as serve() makes it
    await server.startup(sockets=[listener])
    return server, listener, listener.getsockname()[1]


async def test_a_connection_queued_but_not_accepted_when_the_stop_begins_is_answered() -> None:
    server, listener, port = await _serving(_hello)
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


async def test_an_answer_ending_after_the_stop_began_closes_the_connection_kept_alive() -> None:
    """Else its client sends its next request on a connection the server is closing."""
    inside, release = asyncio.Event(), asyncio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/slow":
            inside.set()
            await release.wait()
        await _hello(scope, receive, send)

    server, listener, port = await _serving(app)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    client = h11.Connection(h11.CLIENT)

    async def ask(path: str) -> h11.Response:
        writer.write(client.send(h11.Request(method="GET", target=path, headers=[("Host", "x")])))
        writer.write(client.send(h11.EndOfMessage()))
        response = None
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(await asyncio.wait_for(reader.read(65536), 10))
            elif isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.EndOfMessage):
                assert response is not None
                return response

    try:
        before = await ask("/")  # answered before the stop: the connection is kept alive
        assert (b"connection", b"close") not in before.headers
        client.start_next_cycle()
        slow = asyncio.ensure_future(ask("/slow"))
        await asyncio.wait_for(inside.wait(), 10)
        server.should_exit = True  # as the signal that stops it sets it
        stop = asyncio.ensure_future(server.shutdown(sockets=[listener]))
        release.set()
        after = await slow
        assert (b"connection", b"close") in after.headers, after.headers
        assert await asyncio.wait_for(reader.read(), 10) == b""  # and the server closed it
        await stop
    finally:
        writer.close()

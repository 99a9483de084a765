"""What a guest's connection starts with, read without taking it from the socket (MSG_PEEK), so
a spliced TLS connection passes on the guest's own bytes and a terminated one can read them.

No polling: SO_RCVLOWAT makes the socket readable only once more bytes have come than were
already looked at.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from space.gateway import sniff

MAX_CLIENT_HELLO = 5 + 16384 + 1  # one TLS record


async def first_bytes(conn: socket.socket, timeout: float) -> tuple[str, str | None]:
    """("tls", its SNI or None), ("http", None) for anything else that speaks first, or why
    there is nothing to go by: ("silent client" | "closed" | "unknown protocol", None)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    want = 1
    try:
        while True:
            # Peeking reads nothing, so the kernel would delay its ACK, and a client with Nagle
            # holds the rest of a two-segment ClientHello until then: 40 ms per connection.
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            if not await _readable(conn, deadline - loop.time()):
                return "silent client", None
            try:
                data = conn.recv(MAX_CLIENT_HELLO, socket.MSG_PEEK)
            except BlockingIOError:
                continue
            except OSError:
                return "closed", None
            if not data:
                return "closed", None
            if data[0] != 0x16:
                return "http", None
            try:
                return "tls", _name_or_none(sniff.tls_sni(data))
            except sniff.Incomplete:
                want = len(data) + 1
            except ValueError:
                return "unknown protocol", None
    finally:
        with contextlib.suppress(OSError):  # streams read the socket from now on
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


async def _readable(conn: socket.socket, timeout: float) -> bool:
    if timeout <= 0:
        return False
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(conn.fileno(), _wake, ready)
    try:
        async with asyncio.timeout(timeout):
            await ready
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(conn.fileno())


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)


def _name_or_none(name: str | None) -> str | None:
    if not name:
        return None
    return name.rstrip(".").lower()

"""Byte streams between a guest and an origin: bounded buffers, backpressure, idle timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable
from typing import Protocol

CHUNK = 65536  # the most read at once; a stream's buffer holds at most about twice this
STREAM_ERRORS = (OSError, ssl.SSLError)


async def guest_streams(
    conn: socket.socket, tls: ssl.SSLContext | None, handshake_timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Streams over an accepted guest socket, which they take over (`conn` is left detached)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=CHUNK)
    protocol = asyncio.StreamReaderProtocol(reader)
    sock = socket.socket(fileno=conn.detach())
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, sock, ssl=tls, ssl_handshake_timeout=handshake_timeout if tls else None
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def open_stream(
    address: str, port: int, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    async with asyncio.timeout(timeout):
        return await asyncio.open_connection(address, port, limit=CHUNK)


async def read(reader: asyncio.StreamReader, idle: float) -> bytes:
    """Up to CHUNK bytes; b"" at the end; TimeoutError if nothing came for `idle` seconds."""
    async with asyncio.timeout(idle):
        return await reader.read(CHUNK)


async def write(writer: asyncio.StreamWriter, data: bytes, idle: float) -> None:
    """Write and wait until the peer has taken enough of it (TimeoutError if it stalls)."""
    writer.write(data)
    async with asyncio.timeout(idle):
        await writer.drain()


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, touch: Callable[[int], None]
) -> None:
    try:
        while data := await reader.read(CHUNK):
            touch(len(data))
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except STREAM_ERRORS:
        pass


class Counted(Protocol):
    sent: int  # bytes from a to b
    received: int  # bytes from b to a


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    b: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    idle: float,
    counts: Counted,
) -> bool:
    """Both ways until both ends are done, counting the bytes each way in `counts`; False if
    nothing moved either way for `idle` s."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle) as deadline:
            # Either direction moving keeps the pair alive.
            def a_to_b(n: int) -> None:
                counts.sent += n
                deadline.reschedule(loop.time() + idle)

            def b_to_a(n: int) -> None:
                counts.received += n
                deadline.reschedule(loop.time() + idle)

            await asyncio.gather(_pipe(a[0], b[1], a_to_b), _pipe(b[0], a[1], b_to_a))
        return True
    except TimeoutError:
        return False
    finally:
        close(a[1])
        close(b[1])


def close(writer: asyncio.StreamWriter | None) -> None:
    if writer is not None:
        with contextlib.suppress(Exception):
            writer.close()


def refusal(status: int, reason: str) -> bytes:
    """A whole plain-text response telling the guest why (its connection closes after it)."""
    text = f"space gateway: {reason}\n".encode()
    phrase = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout",
              431: "Request Header Fields Too Large", 502: "Bad Gateway",
              504: "Gateway Timeout"}.get(status, "Error")  # fmt: skip
    return (
        f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode()
        + text
    )

"""Host-to-guest connections over Firecracker's hybrid vsock.

Firecracker maps the guest's virtio-vsock device to a unix socket on the host (`uds_path`).
To reach a guest port, connect to that socket, send `CONNECT <port>\\n` and read one line:
`OK <host-port>\\n` means the guest accepted and the socket is now a plain byte stream to the
guest's listener. Anything else — another line, EOF (nothing listens on that port), or no
answer in time — is a `VsockConnectError`.

The answer is read through the `StreamReader` that the caller then keeps using: the guest may
start talking in the very packet that carries the OK line, and those bytes must stay buffered.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from space.worker.vmm.base import VMMError
from space.worker.vmm.firecracker.client import socket_path

MAX_PORT = 2**32 - 1
_OK_LINE = re.compile(rb"OK ([0-9]{1,10})\n")
_MAX_LINE = 64  # "OK 4294967295\n" is 14 bytes; anything much longer is not Firecracker


class VsockConnectError(VMMError):
    """A hybrid-vsock connection to a guest port could not be established."""


async def connect_hybrid_vsock(
    uds_path: Path, port: int, *, timeout: float = 5.0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a byte stream to guest vsock `port` through Firecracker's socket at `uds_path`.

    Returns the reader and writer positioned just after the `OK` line.
    """
    if not 0 <= port <= MAX_PORT:
        raise VsockConnectError(f"vsock port {port} is out of range (0..{MAX_PORT})")
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout):
            try:
                with socket_path(uds_path) as address:
                    reader, writer = await asyncio.open_unix_connection(address)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise VsockConnectError(
                    f"cannot connect to the VM's vsock socket {uds_path}: {exc.strerror} "
                    "(is the VM running?)"
                ) from None
            writer.write(b"CONNECT %d\n" % port)
            await writer.drain()
            line = await _read_line(reader, port)
        if not _OK_LINE.fullmatch(line):
            raise VsockConnectError(
                f"guest port {port} refused the connection via {uds_path}: expected "
                f"'OK <port>', got {line[:_MAX_LINE]!r}"
            )
    except BaseException as exc:
        if writer is not None:
            writer.close()  # no waiting: this may be a cancellation
        if isinstance(exc, TimeoutError):  # before OSError, of which it is a subclass
            raise VsockConnectError(
                f"no answer to CONNECT {port} on {uds_path} within {timeout:g} s "
                "(is the guest paused, or still booting?)"
            ) from None
        if isinstance(exc, OSError):
            raise VsockConnectError(f"vsock connection to {uds_path} failed: {exc}") from exc
        raise
    return reader, writer


async def _read_line(reader: asyncio.StreamReader, port: int) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as exc:
        detail = f" after {exc.partial[:_MAX_LINE]!r}" if exc.partial else ""
        raise VsockConnectError(
            f"the connection was closed during the handshake{detail}: nothing in the guest "
            f"accepted vsock port {port}"
        ) from None
    except asyncio.LimitOverrunError:
        raise VsockConnectError(
            f"the answer to CONNECT {port} is not a handshake line (too long, no newline)"
        ) from None

"""Connections to TCP ports inside the guest, relayed on a channel (ingress reaches a port
without running any program of the guest's).

The agent connects to an address of the guest itself (loopback by default: the source is bound
to that same address, so an address that is not the guest's is refused), answers EVENT
{"connected": true}, then relays both ways until both have ended. DATA from the host goes to
the socket and END half-closes it; what the socket gives comes back as DATA, its end as END.
Neither side has more than TCP_WINDOW bytes in flight towards the other: the agent sends EVENT
{"ack": n} once it has written n of the host's bytes to the socket, the host CONTROL
{"ack": n} once its reader took n. CONTROL {"close": true} aborts (a reset). The REPLY is
{"sent", "received", "reset", "closed"}: bytes written to the socket and read from it, whether
the connection broke, whether the host aborted it.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import ipaddress
import socket
import struct
from typing import TYPE_CHECKING

from . import protocol as p
from .common import Json, OpError, gather_more, os_error, str_arg

if TYPE_CHECKING:
    from .agent import Connection, Inbox

CONNECT_TIMEOUT_S = 10.0
MAX_CONNECT_TIMEOUT_S = 60.0


async def tcp_connect(conn: Connection, channel: int, req: Json) -> Json:
    port = req.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise OpError(p.ErrorCode.INVALID, "'port' must be a port number (1-65535)")
    host = str_arg(req, "host", required=False, default="127.0.0.1")
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        raise OpError(p.ErrorCode.INVALID, f"'host' must be an IP address, not {host!r}") from None
    timeout = req.get("timeout", CONNECT_TIMEOUT_S)
    if not isinstance(timeout, int | float) or not 0 < timeout <= MAX_CONNECT_TIMEOUT_S:
        raise OpError(p.ErrorCode.INVALID, f"'timeout' must be 0-{MAX_CONNECT_TIMEOUT_S:g} s")
    inbox = conn.inboxes.get(channel)
    if inbox is None:
        return {}  # the host has gone already
    sock = await _connect(family, host, port, timeout)
    return await Relay(conn, channel, sock).run(inbox)


async def _connect(family: int, host: str, port: int, timeout: float) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        # Every write relays bytes the host already gathered: held back for an ACK (Nagle),
        # the second write of a request on a kept connection waits out the service's delayed
        # ACK, 40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((host, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                not_ours = f"{host} is not an address of the guest"
                raise OpError(p.ErrorCode.INVALID, not_ours) from None
            raise
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), timeout)
    except TimeoutError:
        sock.close()
        raise OpError(
            p.ErrorCode.TIMEOUT, f"connecting to {host}:{port} took more than {timeout:g}s"
        ) from None
    except ConnectionRefusedError:
        sock.close()
        raise OpError(
            p.ErrorCode.CONNECTION_REFUSED, f"nothing listens on {host}:{port} in the guest"
        ) from None
    except OSError as e:
        sock.close()
        raise os_error(e, f"{host}:{port}") from None
    except BaseException:
        sock.close()
        raise
    return sock


class Relay:
    """One connected socket and its channel: host bytes in, guest bytes out, both bounded."""

    def __init__(self, conn: Connection, channel: int, sock: socket.socket) -> None:
        self.conn = conn
        self.channel = channel
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.credit = p.TCP_WINDOW  # bytes we may still send to the host
        self.credit_changed = asyncio.Event()
        self.pending: collections.deque[bytes] = collections.deque()  # host bytes not yet written
        self.pending_bytes = 0
        self.pending_changed = asyncio.Event()
        self.host_ended = False
        self.end_sent = False
        self.sent = self.received = 0
        self.reset = self.closed = False
        self.stop = asyncio.Event()  # broken or aborted: everything ends now

    async def run(self, inbox: Inbox) -> Json:
        await self.conn.send_json(p.FrameType.EVENT, self.channel, {"connected": True})
        up = asyncio.ensure_future(self._up())
        down = asyncio.ensure_future(self._down())
        tasks = [
            up,
            down,
            asyncio.ensure_future(self._take(inbox)),
            asyncio.ensure_future(self.stop.wait()),
            asyncio.ensure_future(self.conn.gone.wait()),
        ]
        both = asyncio.ensure_future(asyncio.wait([up, down]))
        try:
            await asyncio.wait([both, *tasks[2:]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*tasks, both):
                task.cancel()
            if self.reset or self.closed or not (up.done() and down.done()):
                # Aborted: the guest's side sees a reset, not a clean end.
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.close()
        if not self.end_sent:
            await self.conn.send(p.FrameType.END, self.channel)
        return {
            "sent": self.sent,
            "received": self.received,
            "reset": self.reset,
            "closed": self.closed,
        }

    async def _take(self, inbox: Inbox) -> None:
        """The host's frames as they come: data queued for the socket (within the window),
        acknowledgements and aborts at once, so neither waits behind the other."""
        while True:
            ftype, payload = await inbox.get()
            if ftype == p.FrameType.DATA and not self.host_ended:
                if self.pending_bytes + len(payload) > p.TCP_WINDOW:
                    self._abort()  # beyond what the host may have in flight
                    return
                self.pending.append(payload)
                self.pending_bytes += len(payload)
                self.pending_changed.set()
            elif ftype == p.FrameType.END:
                self.host_ended = True
                self.pending_changed.set()
            elif ftype == p.FrameType.CONTROL:
                try:
                    ctl = p.decode_json(payload)
                except p.ProtocolError:
                    continue
                ack = ctl.get("ack")
                if isinstance(ack, int) and ack > 0:
                    self.credit = min(self.credit + ack, p.TCP_WINDOW)
                    self.credit_changed.set()
                if ctl.get("close"):
                    self._abort()
                    return

    def _abort(self) -> None:
        self.closed = True
        self.stop.set()

    async def _down(self) -> None:
        """Host bytes to the socket; the host's END half-closes it."""
        while True:
            while not self.pending:
                if self.host_ended:
                    try:
                        self.sock.shutdown(socket.SHUT_WR)
                    except OSError:
                        self._broken()
                    return
                self.pending_changed.clear()
                await self.pending_changed.wait()
            data = self.pending.popleft()
            try:
                await self.loop.sock_sendall(self.sock, data)
            except OSError:
                self._broken()
                return
            self.pending_bytes -= len(data)
            self.sent += len(data)
            await self.conn.send_json(p.FrameType.EVENT, self.channel, {"ack": len(data)})

    async def _up(self) -> None:
        """Socket bytes to the host, never more than it has room for; then END."""
        while True:
            while self.credit <= 0:
                self.credit_changed.clear()
                await self.credit_changed.wait()
            try:
                data = await self.loop.sock_recv(self.sock, min(self.credit, p.CHUNK_SIZE))
            except OSError:
                self._broken()
                data = b""
            if not data:
                self.end_sent = True
                await self.conn.send(p.FrameType.END, self.channel)
                return
            short = len(data) < min(self.credit, p.CHUNK_SIZE)
            self.credit -= len(data)
            self.received += len(data)
            await self.conn.send(p.FrameType.DATA, self.channel, data)
            if short:
                await gather_more(self.stop)

    def _broken(self) -> None:
        self.reset = True
        self.stop.set()

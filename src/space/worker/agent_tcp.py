"""A TCP connection inside the guest, made by the agent (`tcp_connect`), as a stream of bytes
both ways with half-close; see `space.guest.tcp` for the protocol.

At most p.TCP_WINDOW bytes are in flight each way, and the client holds the guest to it: a
guest that sends more than its window is cut off, so one connection never holds more than that
here, however slowly it is read.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from space.guest import protocol as p
from space.worker.agent_channels import (
    CLOSED,
    AgentError,
    AgentProtocolError,
    Channel,
    SendWindow,
    field,
    within,
)

TCP_CLOSE_DEADLINE_S = 10.0


@dataclass(frozen=True)
class TcpClosed:
    """How a guest TCP connection ended: bytes written to its socket and read from it."""

    sent: int
    received: int
    reset: bool  # the connection broke (a reset, or the guest's side vanished)
    closed: bool  # we aborted it


class TcpStream:
    """A TCP connection the agent made inside the guest: bytes both ways, half-close.

    `read()` gives the guest's bytes (b"" once it closed its side), `write()` sends ours,
    `close_write()` ends our side, `close()` aborts whatever is left. At most p.TCP_WINDOW
    bytes are in flight each way: a slow reader here stops the agent reading the socket, a
    guest that does not read stops `write()`. Reads and writes wait at most `idle_timeout`.
    Use it as an async context manager (or `close()` it): a stream left open holds a socket in
    the guest and its channel here until the connection to the agent ends.
    """

    def __init__(self, channel: Channel, idle_timeout: float | None) -> None:
        self._ch = channel
        self._idle = idle_timeout
        # Bytes we sent that the agent has not written to the socket yet.
        self._window = SendWindow(channel, p.TCP_WINDOW, idle_timeout,
                                  "writing to a guest TCP connection")  # fmt: skip
        self._held = 0  # bytes queued here for our reader: the agent's credit is what is left
        self._unacked = 0  # bytes our reader took that the agent has not been told of
        self._eof = False
        self._write_closed = False
        self._connected = False
        channel.intercept = self._on_frame

    def _on_frame(self, ftype: p.FrameType, payload: bytes) -> bool:
        """Acknowledgements are taken as they come (a writer waits for them while our reader may
        be busy elsewhere); the guest's data is counted against its window."""
        if ftype == p.FrameType.EVENT and self._connected:
            self._window.on_frame(ftype, payload)
            return True
        if ftype == p.FrameType.EVENT:
            self._connected = True  # the first event, {"connected": true}, for tcp_connect
            return False
        if ftype == p.FrameType.DATA:
            if self._held + self._unacked + len(payload) > p.TCP_WINDOW:  # past its credit
                self._fail(f"the guest sent more than the {p.TCP_WINDOW} bytes it may")
                return True
            self._held += len(payload)
        return False

    def _fail(self, why: str) -> None:
        error = AgentProtocolError("protocol", why)
        if not self._ch.reply.done():
            self._ch.reply.set_exception(error)
            self._ch.reply.exception()  # retrieved: nobody may be waiting for it
        self._ch.drop()
        self._ch.close_frames()
        self._window.wake()
        self._ch.client._spawn(self._ch.send_json(p.FrameType.CONTROL, {"close": True}))

    async def read(self) -> bytes:
        """The next bytes from the guest; b"" once it closed its side (or the stream ended)."""
        while not self._eof:
            frame = await self._ch.next_frame(self._idle, "reading a guest TCP connection")
            ftype, data = frame
            if frame is CLOSED:  # the reply came (or the connection went) before an END
                self._eof = True
                await self._ch.result()  # its error, if it ended in one
            elif ftype == p.FrameType.END:
                self._eof = True
            elif ftype == p.FrameType.DATA:
                self._held -= len(data)
                self._unacked += len(data)
                if self._unacked >= p.TCP_WINDOW // 4:
                    ack, self._unacked = self._unacked, 0
                    with contextlib.suppress(AgentError):
                        await self._ch.send_json(p.FrameType.CONTROL, {"ack": ack})
                if data:
                    return data
        return b""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while data := await self.read():
            yield data

    async def write(self, data: bytes) -> None:
        """Send `data`; waits while the guest has a window's worth of ours unread."""
        if self._write_closed:
            raise AgentError("invalid", "our side of the connection is closed")
        if not await self._ch.send_within(p.FrameType.DATA, data, self._window):
            raise AgentError("closed", "the guest TCP connection has ended")

    async def close_write(self) -> None:
        """Half-close: the guest's side reads its end; it may go on sending."""
        if not self._write_closed:
            self._write_closed = True
            await self._ch.send(p.FrameType.END)

    async def wait_closed(self) -> TcpClosed:
        """Once both sides have ended (or it was aborted): how it went."""
        body = await self._ch.result(self._idle, "waiting for a guest TCP connection to end")
        return TcpClosed(
            sent=field(body, "sent", int),
            received=field(body, "received", int),
            reset=bool(body.get("reset")),
            closed=bool(body.get("closed")),
        )

    async def close(self) -> TcpClosed | None:
        """Abort whatever is still open (the guest's side sees a reset) and forget the stream."""
        try:
            if not self._ch.reply.done():
                with contextlib.suppress(AgentError):
                    await self._ch.send_json(p.FrameType.CONTROL, {"close": True})
            self._ch.discard()
            return await within(self.wait_closed(), TCP_CLOSE_DEADLINE_S, "closing a TCP stream")
        except AgentError:
            return None
        finally:
            self._ch.drop()

    async def __aenter__(self) -> TcpStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

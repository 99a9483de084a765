"""One connection to a guest agent: authentication, framing, channels, flow control.

The guest belongs to the tenant, who is root there: its agent may be hostile. From its WELCOME
on, any break of the framing drops the connection; no frame longer than `p.MAX_PAYLOAD` is ever
buffered (a header that says more is such a break), no REPLY or EVENT longer than `p.MAX_JSON`
is decoded, and a frame of ours the agent does not take within SEND_DEADLINE_S fails the send.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self

from space.guest import protocol as p
from space.worker.agent_channels import AgentAuthError, AgentConnectionLost, Channel, within

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]

BUFFER_HIGH = 16 << 20
BUFFER_LOW = 4 << 20
SEND_DEADLINE_S = 60.0  # for the agent to take a frame of ours
HELLO_RETRY_S = 5.0  # for the agent to answer one stream's hello


class AgentConnection:
    """One authenticated connection to a guest agent: framing, channels, flow control."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._channels: dict[int, Channel] = {}
        # Ids start at a random point, so a stale connection's channels never meet new ones.
        self._ids = itertools.count(secrets.randbelow(1 << 30) + 1)
        self._hello: tuple[bytes, bytes, asyncio.Future[bool]] | None = None
        self._send_lock = asyncio.Lock()
        self._lost: AgentConnectionLost | None = None
        # Flow control: the reader stops taking from the agent while more than BUFFER_HIGH bytes
        # wait for consumers, so a slow (or absent) reader pushes back on the guest instead of
        # filling the worker's memory.
        self._buffered = 0
        self._room = asyncio.Event()
        self._room.set()
        self._background: set[asyncio.Future[Any]] = set()
        self._reader_task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def connect(
        cls,
        open_stream: Callable[[], Awaitable[StreamPair]],
        token: str,
        timeout: float = 30.0,
    ) -> Self:
        """Open a stream and authenticate; waits up to `timeout` for the agent to answer. A hello
        unanswered for HELLO_RETRY_S is sent again on a new stream: the guest's port drops
        what arrived while its agent was reopening it (after the last stream closed, or a
        restore), and a new stream tells the agent afresh."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            attempt = min(HELLO_RETRY_S, left)
            reader, writer = await within(open_stream(), left, "opening the agent's stream")
            client = cls(reader, writer)
            try:
                await asyncio.wait_for(client.hello(token), attempt)
            except TimeoutError:
                await client.close()
                if deadline - loop.time() > 0.5:
                    continue
                raise AgentConnectionLost(
                    "timeout", f"the guest agent did not answer within {timeout:.1f}s"
                ) from None
            except BaseException:
                await client.close()
                raise
            return client

    async def hello(self, token: str) -> None:
        """Authenticate; everything the agent sent before its WELCOME is ignored."""
        nonce = secrets.token_hex(8)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._hello = (p.welcome_frame(nonce, True), p.welcome_frame(nonce, False), fut)
        await self._send(p.encode_json(p.FrameType.HELLO, 0, {"token": token, "nonce": nonce}))
        if not await fut:
            raise AgentAuthError("unauthenticated", "the guest agent refused our token")

    async def _send(self, frame: bytes) -> None:
        if self._lost is not None:
            raise self._lost
        async with self._send_lock:
            try:
                # Room first, then the frame: the transport holds at most one frame beyond its
                # high-water mark, however many senders the agent makes wait.
                await within(self._writer.drain(), SEND_DEADLINE_S, "sending to the agent")
                self._writer.write(frame)
                await within(self._writer.drain(), SEND_DEADLINE_S, "sending to the agent")
            except (ConnectionError, OSError) as e:
                self._mark_lost(f"write failed: {e}")
                raise self._lost or AgentConnectionLost("lost", str(e)) from None

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` in the background (a farewell frame); its failure does not matter."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _read_loop(self) -> None:
        # In step from the WELCOME on: any bad header there is a broken (or hostile) agent.
        decoder = p.FrameDecoder(strict=True)
        reason = "the agent closed the connection"
        unsynced = bytearray()
        try:
            while True:
                data = await self._reader.read(p.CHUNK_SIZE)
                if not data:
                    break
                if self._hello is not None:
                    unsynced += data
                    data = self._find_welcome(unsynced)
                    if self._hello is not None:
                        continue
                for ftype, cid, payload in decoder.feed(data):
                    self._route(ftype, cid, payload)
                await self._room.wait()
        except (ConnectionError, OSError) as e:
            reason = f"connection error: {e}"
        except p.ProtocolError as e:
            reason = f"the agent broke the protocol: {e}"
            self._writer.transport.abort()
        self._mark_lost(reason)

    def _find_welcome(self, buf: bytearray) -> bytes:
        """Look for our WELCOME in what has come so far; return what follows it once found."""
        assert self._hello is not None
        accepted, refused, fut = self._hello
        for frame, ok in ((accepted, True), (refused, False)):
            at = buf.find(frame)
            if at >= 0:
                rest = bytes(buf[at + len(frame) :])
                buf.clear()
                self._hello = None
                if not fut.done():
                    fut.set_result(ok)
                return rest
        keep = max(len(accepted), len(refused))
        del buf[:-keep]  # older bytes can no longer start our WELCOME
        return b""

    def _buffered_add(self, n: int) -> None:
        self._buffered += n
        if self._buffered > BUFFER_HIGH:
            self._room.clear()
        elif self._buffered <= BUFFER_LOW:
            self._room.set()

    def _route(self, ftype: p.FrameType, cid: int, payload: bytes) -> None:
        if ftype in (p.FrameType.REPLY, p.FrameType.EVENT) and len(payload) > p.MAX_JSON:
            raise p.ProtocolError(f"a {ftype.name} of {len(payload)} bytes (at most {p.MAX_JSON})")
        ch = self._channels.get(cid)
        if ch is None:
            return  # left over from before a restore, or a channel we gave up on
        if ftype == p.FrameType.REPLY:
            self._channels.pop(cid, None)
            try:
                body = p.decode_json(payload)
            except p.ProtocolError as e:
                body = p.error_body("protocol", str(e))
            if not ch.reply.done():
                ch.reply.set_result(body)
            ch.close_frames()
        else:
            ch.put((ftype, payload))

    def _mark_lost(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = AgentConnectionLost("lost", f"connection to the guest agent lost: {reason}")
        if self._hello is not None and not self._hello[2].done():
            self._hello[2].set_exception(self._lost)
        for ch in self._channels.values():
            if not ch.reply.done():
                ch.reply.set_exception(self._lost)
            ch.close_frames()
        self._channels.clear()

    @property
    def connected(self) -> bool:
        return self._lost is None

    async def close(self) -> None:
        self._mark_lost("closed by the host")
        self._reader_task.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(self._reader_task, *self._background, return_exceptions=True)
        if self._writer.transport.get_write_buffer_size():
            self._writer.transport.abort()  # an agent that stopped reading gets nothing more
        else:
            self._writer.close()
        with contextlib.suppress(TimeoutError, OSError, RuntimeError):
            await asyncio.wait_for(self._writer.wait_closed(), 5)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- channels ----------------------------------------------------------------------------

    async def _open(self, op: str, args: dict[str, Any], *, keep_frames: bool = True) -> Channel:
        ch = Channel(self, next(self._ids), keep_frames=keep_frames)
        return await self._request(ch, op, args)

    async def _request(self, ch: Channel, op: str, args: dict[str, Any]) -> Channel:
        self._channels[ch.id] = ch
        try:
            await ch.send_json(p.FrameType.REQUEST, {"op": op, **args})
        except BaseException:
            ch.drop()
            raise
        return ch

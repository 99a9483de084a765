"""Kept connections to the ports of sandboxes: HTTP/1.1 keep-alive for ingress.

A new connection to a service in a sandbox costs a WebSocket to its worker and a TCP connection
the agent opens in the guest: under TCG, tens of milliseconds a request. Once an exchange ended
cleanly (request and answer whole, neither side asked to close, nothing unread), its tunnel is
kept for the next request to the same port of the same sandbox on the same worker.

- One task owns each tunnel from its start to its end (its WebSocket cannot change tasks); a
  request is handed to it as an `Exchange`.
- While idle, a tunnel tells its worker so (TCP_REST): a kept connection is no use of the
  sandbox, whose idle timeout runs meanwhile. It watches its WebSocket: the service closing its
  side (its own keep-alive timeout) or sending anything unasked ends the tunnel at once, so a
  kept connection is seldom found dead. Idle for IDLE_S, it ends.
- A kept tunnel that ends before any byte of the answer: the request is sent again on a new one
  when that is safe, that is when nothing of it was written yet, or its method is idempotent
  and it has no body (RFC 9110, 9.2.2). Otherwise the client gets the 502 it got before.
- A client that goes away mid-exchange ends the tunnel: a half-read answer cannot go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import h11
import httpx
import wsproto.events as wse
from httpx_ws import AsyncWebSocketSession, HTTPXWSException
from httpx_ws import WebSocketDisconnect as UpstreamDisconnect
from starlette.requests import ClientDisconnect, Request
from wsproto.utilities import LocalProtocolError

from space.api.errors import APIError
from space.worker.api.client import WorkerError
from space.worker.api.models import TCP_FRAME, TCP_REST

IDLE_S = 60.0  # a kept tunnel no request used for this long is closed
FRESH_S = 1.0  # kept at most this long, a tunnel takes requests that cannot be sent again
IDLE_PER_PORT = 4  # kept tunnels per (worker, sandbox, port); more are closed after their answer
# Each kept tunnel holds a connection of the worker client's pool (200): most stay for calls.
IDLE_IN_ALL = 64
IDEMPOTENT = {"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"}
# A tunnel's ends: closed by the worker or the service, broken, or closing as we write.
GONE = (UpstreamDisconnect, HTTPXWSException, LocalProtocolError, OSError, httpx.HTTPError)

Connect = Callable[[], AbstractAsyncContextManager[AsyncWebSocketSession]]
Key = tuple[str, str, int]  # worker, sandbox, port


class Closed(Exception):
    """The connection to the service ended: `status` for the client if no answer had begun."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class Resend(Exception):
    """A kept tunnel ended before it answered, and the request may go again on a new one."""


class Exchange:
    """One request to the service and its answer: the answer's head to `head` (or the APIError
    that there is none), then its body into `chunks`, None at its end."""

    def __init__(
        self, request: Request, head: h11.Request, port: int, body_read: bool = False
    ) -> None:
        self.request, self.request_head, self.port = request, head, port
        self.body_read = body_read  # a resent request's (empty) body was read the first time
        self.head: asyncio.Future[h11.Response] = asyncio.get_running_loop().create_future()
        # A few chunks in flight: a slow client slows the service down (the agent's windows do
        # the rest), nothing piles up here.
        self.chunks: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)
        self.owner: asyncio.Task[None] | None = None  # the tunnel's task, while it runs this
        self.written = False  # any byte of the request
        self.sent = False  # the whole request, its body's end included

    def again(self) -> Exchange:
        return Exchange(self.request, self.request_head, self.port, body_read=self.written)

    @property
    def replayable(self) -> bool:
        h = self.request.headers
        bodiless = h.get("content-length", "0") == "0" and "transfer-encoding" not in h
        return self.request.method in IDEMPOTENT and bodiless

    def fail(self, error: Exception) -> None:
        if not self.head.done():
            self.head.set_exception(error)

    async def stop(self) -> None:
        """End the exchange where it is (its client left, or waited too long): its tunnel
        with it, unless the exchange already ended and the tunnel moved on."""
        owner, self.owner = self.owner, None
        if owner is not None:
            await _stop(owner)

    async def run(self, ws: AsyncWebSocketSession, conn: h11.Connection) -> bool:
        """Send the request and relay the answer; whether the connection may carry another."""
        await _send(ws, conn, self.request_head)
        self.written = True
        owner = asyncio.current_task()
        assert owner is not None
        gone = functools.partial(_cancel_once, owner)
        sending = asyncio.ensure_future(self._send_body(ws, conn, gone))
        try:
            async for event in _events(ws, conn):
                if isinstance(event, h11.Response):
                    self.head.set_result(event)
                else:
                    await self.chunks.put(bytes(event.data))
        finally:
            await _stop(sending)
        if not self.head.done():
            raise Closed(502, "the connection ended before an answer")
        # Answers that must have no body are where careless services write one anyway: bytes
        # that would arrive after the end and be read as the next request's answer.
        bodiless = self.request.method == "HEAD" or self.head.result().status_code in (204, 304)
        return (
            self.sent
            and not bodiless
            and conn.our_state is h11.DONE
            and conn.their_state is h11.DONE
            and not conn.trailing_data[0]
        )

    async def _send_body(
        self, ws: AsyncWebSocketSession, conn: h11.Connection, gone: Callable[[], object]
    ) -> None:
        """The client's body, as it arrives; then `gone()` once the client hangs up, so a
        service that is quiet for a while (a long computation) learns at once that nobody waits
        for it. Our side of the connection stays open meanwhile: the request is framed, and
        servers that take a half-close for a hang-up (tornado, Node's by default) would drop it
        unanswered."""
        try:
            if not self.body_read:
                async for chunk in self.request.stream():
                    if chunk:
                        await _send(ws, conn, h11.Data(data=chunk))
            await _send(ws, conn, h11.EndOfMessage())
            self.sent = True
            while (await self.request.receive())["type"] != "http.disconnect":
                pass
        except ClientDisconnect:  # gone in the middle of its body
            pass
        gone()


class Tunnel:
    """A connection to one port of one sandbox, owned by its task, kept between exchanges."""

    def __init__(self, pool: Tunnels, key: Key, connect: Connect, first: Exchange) -> None:
        self.pool, self.key = pool, key
        self.next: asyncio.Future[Exchange] | None = None  # set while idle
        self.since = 0.0  # when it was last kept (monotonic)
        self.task = asyncio.ensure_future(self._serve(connect, first))
        self.task.add_done_callback(lambda _: pool.live.discard(self))

    def give(self, exchange: Exchange) -> None:
        assert self.next is not None and not self.next.done()
        self.next.set_result(exchange)

    async def _serve(self, connect: Connect, first: Exchange) -> None:
        current: Exchange | None = first
        reused = False
        cancelled = False
        try:
            async with connect() as ws:
                try:
                    conn = h11.Connection(h11.CLIENT)
                    while current is not None:
                        current.owner = asyncio.current_task()
                        if not await current.run(ws, conn):
                            break
                        await self._finish(current)
                        current = None
                        conn.start_next_cycle()
                        current = await self._idle(ws)
                        reused = True
                finally:
                    await close_tunnel(ws)
        except (Closed, UpstreamDisconnect, HTTPXWSException, LocalProtocolError) as e:
            if current is not None:
                current.fail(_error(e, current, reused))
        except (OSError, httpx.HTTPError) as e:  # the worker itself out of reach
            if current is not None:
                current.fail(APIError(503, f"the sandbox's worker did not answer: {e}"))
        except WorkerError as e:  # refused before any connection (its address, its TLS)
            if current is not None:
                current.fail(e)
        except asyncio.CancelledError:  # the client went away: nobody waits for more
            cancelled = True
            if current is not None:
                current.fail(APIError(502, "the client went away before an answer"))
            raise
        finally:
            self.pool.forget(self)
            if current is not None:
                await self._finish(current, cancelled)

    async def _finish(self, exchange: Exchange, cancelled: bool = False) -> None:
        """The answer's end (also where it broke off), once it began. After a cancel its reader
        may be gone with the queue full: then only for one still waiting on it. The exchange
        is the tunnel's until then, so a reader that leaves meanwhile ends the tunnel."""
        if not exchange.head.done():  # never written, or broken off in an unforeseen way
            why = APIError(502, f"port {exchange.port} in the sandbox: no answer")
            exchange.fail(Resend() if not exchange.written else why)
        elif cancelled:
            with contextlib.suppress(asyncio.QueueFull):
                exchange.chunks.put_nowait(None)
        else:
            await exchange.chunks.put(None)
        exchange.owner = None

    async def _idle(self, ws: AsyncWebSocketSession) -> Exchange | None:
        """The next exchange given to this tunnel, or None: it was not wanted within IDLE_S, the
        service closed its side or sent what nobody asked for, or the pool is full."""
        try:
            await ws.send_text(TCP_REST)  # kept, not in use: the sandbox may idle-pause
        except GONE:
            return None
        self.next = asyncio.get_running_loop().create_future()
        if not self.pool.keep(self):
            return None
        watch: asyncio.Future[Any] = asyncio.ensure_future(ws.receive())
        try:
            await asyncio.wait([watch, self.next], timeout=IDLE_S,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            self.pool.forget(self)
            await _stop(watch)
        given = self.next.result() if self.next.done() else None
        self.next = None
        if watch.done() and not watch.cancelled() and given is not None:
            given.fail(Resend())  # nothing of it was written: it goes on a new tunnel
            return None
        return given


class Tunnels:
    """The kept tunnels of this API process, idle ones by (worker, sandbox, port)."""

    def __init__(self) -> None:
        self.idle: dict[Key, list[Tunnel]] = {}
        self.live: set[Tunnel] = set()

    def send(self, key: Key, connect: Connect, exchange: Exchange, kept: bool = True) -> None:
        """Hand the exchange to a kept tunnel of `key` if there is one, else to a new one."""
        idle = self.idle.get(key) if kept else None
        # A request that cannot be sent again goes only on a tunnel kept a moment ago: the
        # longer one was kept, the likelier its service is closing it just now (see above).
        if idle and (exchange.replayable or time.monotonic() - idle[-1].since < FRESH_S):
            tunnel = idle[-1]
            self.forget(tunnel)
            tunnel.give(exchange)
            return
        self.live.add(Tunnel(self, key, connect, exchange))

    def keep(self, tunnel: Tunnel) -> bool:
        kept = sum(len(idle) for idle in self.idle.values())
        idle = self.idle.setdefault(tunnel.key, [])
        if len(idle) >= IDLE_PER_PORT or kept >= IDLE_IN_ALL:
            self._drop(tunnel.key, idle)
            return False
        idle.append(tunnel)
        tunnel.since = time.monotonic()
        return True

    def forget(self, tunnel: Tunnel) -> None:
        """The tunnel is busy or gone: not idle any more."""
        idle = self.idle.get(tunnel.key, [])
        if tunnel in idle:
            idle.remove(tunnel)
        self._drop(tunnel.key, idle)

    def _drop(self, key: Key, idle: list[Tunnel]) -> None:
        if not idle:
            self.idle.pop(key, None)

    async def close(self) -> None:
        tasks = [t.task for t in self.live]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def exchange(
    tunnels: Tunnels, key: Key, connect: Connect, request: Request, head: h11.Request,
    timeout: float,
) -> tuple[Exchange, h11.Response]:  # fmt: skip
    """Send the request over a kept tunnel or a new one, and wait for the answer's head (at
    most `timeout` seconds: then 504). Sent once more on a new tunnel if a kept one could not
    take it (see the module's docstring)."""
    port = key[2]
    current = Exchange(request, head, port)
    tunnels.send(key, connect, current)
    try:
        async with asyncio.timeout(timeout):
            try:
                return current, await asyncio.shield(current.head)
            except Resend:
                current = current.again()
                tunnels.send(key, connect, current, kept=False)
            try:
                return current, await asyncio.shield(current.head)
            except Resend:
                why = f"port {port} in the sandbox: the connection ended before an answer"
                raise APIError(502, why) from None
    except TimeoutError:
        await current.stop()
        why = f"port {port} in the sandbox did not answer in {timeout:.0f} s"
        raise APIError(504, why) from None
    except BaseException:
        await current.stop()
        raise


def _error(e: Exception, exchange: Exchange, reused: bool) -> Exception:
    if reused and not exchange.head.done() and (not exchange.written or exchange.replayable):
        return Resend()
    status = 502
    if isinstance(e, Closed):
        status = e.status
    elif isinstance(e, UpstreamDisconnect) and 4000 <= e.code < 4600:
        status = e.code - 4000  # the worker's: 4000 + the HTTP status it means
    return APIError(status, f"port {exchange.port} in the sandbox: {_why(e)}")


async def _send(ws: AsyncWebSocketSession, conn: h11.Connection, event: h11.Event) -> None:
    await write_tcp(ws, conn.send(event) or b"")


async def write_tcp(ws: AsyncWebSocketSession, data: bytes) -> None:
    """Bytes to the service, in frames the worker takes."""
    for i in range(0, len(data), TCP_FRAME):
        await ws.send_bytes(data[i : i + TCP_FRAME])


async def _events(
    ws: AsyncWebSocketSession, conn: h11.Connection
) -> AsyncGenerator[h11.Response | h11.Data, None]:
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


async def _stop(task: asyncio.Future[Any]) -> None:
    """Cancel the task and wait for its end. A cancel of the caller meanwhile is the caller's
    (it propagates); the task's own end, whatever it was, is not."""
    _cancel_once(task)
    await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: how it ended no longer matters


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


def _cancel_once(task: asyncio.Future[Any]) -> None:
    """Cancel the task unless it is already being cancelled."""
    if task.done() or (isinstance(task, asyncio.Task) and task.cancelling()):
        return
    task.cancel()

"""HTTP/1.1 on a guest connection (plain, or TLS the gateway terminated): every request parsed,
checked and rebuilt before it goes upstream, bodies streamed in the framing h11 parsed, each
response relayed (masked where secrets could come back). Keep-alive on both sides; the origin
connection is reused while the origin allows it."""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11

from space.gateway import heads, masking, splice
from space.gateway.heads import Refused
from space.gateway.masking import Decoder, Masker, Unmaskable, values_for
from space.gateway.policy import Secret
from space.networks import IPAddress

if TYPE_CHECKING:
    from space.gateway.sandboxes import Connection, Sandbox
    from space.gateway.server import Gateway

# A request body is checked for placeholders before any of it goes upstream, up to this much;
# beyond it, it streams on (a placeholder found later still never leaves: the bytes it is in
# are held back, and the request is cut off).
BODY_WINDOW = 65536
RESPONSE_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                          b"upgrade", b"proxy-authenticate", b"proxy-connection"})  # fmt: skip


@dataclass
class Upstream:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    address: str
    h11: h11.Connection


class HttpSession:
    """One guest connection's requests. `name` is None for plain HTTP until its first request
    names a host (then every later request must name the same one)."""

    def __init__(
        self,
        gateway: Gateway,
        sandbox: Sandbox,
        connection: Connection,
        tls: bool,
        name: str | None,
        addresses: list[IPAddress],
        streams: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.gateway, self.sandbox, self.connection = gateway, sandbox, connection
        self.port, self.tls = connection.port, tls
        self.name, self.addresses = name, addresses
        self.reader, self.writer = streams
        self.kind = "https" if tls else "http"
        self.config = gateway.config
        self.upstream: Upstream | None = None

    async def run(self) -> None:
        leftover, first = b"", True
        try:
            while True:
                guest: h11.Connection | None = None
                try:
                    got = await self._read_head(leftover, first)
                    if got is None:
                        return
                    guest, request = got
                    if not await self._exchange(guest, request):
                        return
                except Refused as e:
                    self._deny(e)
                    if guest is None or guest.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                        await self._refuse(e)
                    return
                except h11.LocalProtocolError as e:  # what the origin sent cannot go on as HTTP
                    self._deny(Refused(f"response could not be relayed: {e}", 502))
                    return
                except (TimeoutError, *splice.STREAM_ERRORS):
                    return
                leftover, first = guest.trailing_data[0], False
        finally:
            if self.upstream is not None:
                splice.close(self.upstream.writer)
            splice.close(self.writer)

    def _deny(self, e: Refused) -> None:
        self.gateway.audit.record(
            self.sandbox.id, self.kind, "deny", e.reason, self.name, self.port, e.address
        )

    async def _refuse(self, e: Refused) -> None:
        self.writer.write(splice.refusal(e.status, e.reason))
        try:
            await splice.write(self.writer, b"", self.config.idle_timeout)
        except (TimeoutError, *splice.STREAM_ERRORS):
            pass

    async def _read_head(
        self, leftover: bytes, first: bool
    ) -> tuple[h11.Connection, h11.Request] | None:
        """The next request's head, whole within head_timeout of its first byte (of the
        connection, for the first request); None when the guest is done or idles between
        requests."""
        loop = asyncio.get_running_loop()
        buffer = bytearray(leftover)
        deadline = loop.time() + self.config.head_timeout if first or buffer else None
        start = 0  # where the head's end may be: earlier bytes were searched already
        while (end := heads.head_length(buffer, start)) is None:
            start = max(0, len(buffer) - 3)
            if len(buffer) > heads.MAX_HEAD:
                raise Refused("request head too large", 431)
            wait = self.config.idle_timeout if deadline is None else deadline - loop.time()
            try:
                data = await splice.read(self.reader, max(0.0, wait))
            except TimeoutError:
                if deadline is None:
                    return None  # an idle keep-alive connection: closed quietly
                raise Refused(
                    f"no whole request head within {self.config.head_timeout:g} s", 408
                ) from None
            if not data:
                if buffer:
                    raise Refused("connection closed inside a request head", 400)
                return None
            buffer += data
            if deadline is None:
                deadline = loop.time() + self.config.head_timeout
        return heads.parse(bytes(buffer[:end]), bytes(buffer[end:]))

    async def _exchange(self, guest: h11.Connection, request: h11.Request) -> bool:
        """One request and its response; whether the connection can carry another."""
        host, checked = heads.check(request, self.name, self.port, self.tls)
        if self.name is None:
            _, self.addresses = await self.gateway.route(
                self.sandbox, self.connection, self.kind, host
            )
            self.name = host
        policy = self.sandbox.policy
        values = values_for(policy, host)
        out, injected = heads.rewrite(policy, host, self.tls, request, checked, bool(values))
        if guest.they_are_waiting_for_100_continue:
            # Its body is wanted: the gateway reads it (to check it) before the origin does.
            self.writer.write(guest.send(h11.InformationalResponse(status_code=100, headers=[])))
        upstream = await self._connect()
        why = f"{checked.method} request" + (
            f"; injected {', '.join(injected)}" if injected else ""
        )
        self.gateway.audit.record(
            self.sandbox.id, self.kind, "allow", why, host, self.port, upstream.address
        )
        await self._send_request(guest, upstream, out, policy.secrets)
        await self._relay(guest, upstream, values)
        if upstream.h11.our_state is h11.DONE and upstream.h11.their_state is h11.DONE:
            upstream.h11.start_next_cycle()
        else:
            splice.close(upstream.writer)
            self.upstream = None
        return guest.our_state is h11.DONE and guest.their_state is h11.DONE

    async def _connect(self) -> Upstream:
        if self.upstream is not None:
            return self.upstream
        assert self.name is not None
        reader, writer, address = await self.gateway.dial(
            self.sandbox, self.name, self.addresses, self.port
        )
        if self.tls:
            try:
                # The upstream certificate must be valid for the same name (no fronting).
                await writer.start_tls(self.gateway.client_tls, server_hostname=self.name)
            except (ssl.SSLError, OSError) as e:
                splice.close(writer)
                raise Refused(
                    f"upstream certificate not valid for {self.name}: {e}", 502, address
                ) from None
        self.upstream = Upstream(reader, writer, address, h11.Connection(h11.CLIENT))
        return self.upstream

    async def _send_request(
        self, guest: h11.Connection, upstream: Upstream, out: h11.Request, secrets: list[Secret]
    ) -> None:
        """The rebuilt head, then the body as h11 framed it, held back while it could still
        hold a placeholder (the head too, for a body that fits the window)."""
        assert self.name is not None
        stand_ins = [(s, s.placeholder.encode()) for s in secrets if s.placeholder]
        keep = max((len(p) for _, p in stand_ins), default=1) - 1
        held = bytearray()
        pending = upstream.h11.send(out) or b""
        while True:
            try:
                event = guest.next_event()
            except h11.RemoteProtocolError as e:
                raise Refused(f"malformed request: {e}", 400) from None
            if event is h11.NEED_DATA:
                try:
                    data = await splice.read(self.reader, self.config.idle_timeout)
                except TimeoutError:
                    raise Refused(
                        f"request body idle for {self.config.idle_timeout:g} s", 408
                    ) from None
                guest.receive_data(data)
                continue
            if isinstance(event, h11.Data):
                start = max(0, len(held) - keep)
                held += event.data
                for secret, stand_in in stand_ins:
                    if stand_in in held[start:]:
                        heads.check_placeholder(secret, self.name, self.tls, "body")
                if len(held) < BODY_WINDOW:
                    continue
                cut = len(held) - keep
                pending += upstream.h11.send(h11.Data(data=bytes(held[:cut]))) or b""
                del held[:cut]
            elif isinstance(event, h11.EndOfMessage):
                if held:
                    pending += upstream.h11.send(h11.Data(data=bytes(held))) or b""
                pending += upstream.h11.send(h11.EndOfMessage()) or b""  # trailers dropped
                await self._upstream_write(upstream, pending)
                return
            await self._upstream_write(upstream, pending)
            pending = b""

    async def _upstream_write(self, upstream: Upstream, data: bytes) -> None:
        await splice.write(upstream.writer, data, self.config.idle_timeout)
        self.connection.sent += len(data)

    async def _relay(self, guest: h11.Connection, upstream: Upstream, values: list[bytes]) -> None:
        masker = Masker(values) if values else None
        decoder: Decoder | None = None
        while True:
            try:
                event = upstream.h11.next_event()
            except h11.RemoteProtocolError as e:
                ended = upstream.h11.trailing_data[1]
                what = "closed before its response was whole" if ended else f"sent bad HTTP: {e}"
                raise Refused(f"origin {what}", 502, upstream.address) from None
            if event is h11.NEED_DATA:
                try:
                    data = await splice.read(upstream.reader, self.config.idle_timeout)
                except TimeoutError:
                    raise Refused(
                        f"origin silent for {self.config.idle_timeout:g} s", 504, upstream.address
                    ) from None
                self.connection.received += len(data)
                upstream.h11.receive_data(data)
            elif isinstance(event, h11.InformationalResponse):
                continue  # 100 Continue: the gateway gave the guest its own
            elif isinstance(event, h11.Response):
                decoder = self._respond(guest, upstream, event, masker)
            elif isinstance(event, h11.Data):
                try:
                    for piece in (event.data,) if decoder is None else decoder.feed(event.data):
                        data = piece if masker is None else masker.feed(piece)
                        if data:
                            await splice.write(self.writer, guest.send(h11.Data(data=data)) or b"",
                                               self.config.idle_timeout)  # fmt: skip
                except Unmaskable as e:
                    raise Refused(f"origin sent {e}", 502, upstream.address) from None
            elif isinstance(event, h11.EndOfMessage):
                rest = b"" if masker is None else masker.flush()
                out = (guest.send(h11.Data(data=rest)) or b"") if rest else b""
                out += guest.send(h11.EndOfMessage()) or b""
                await splice.write(self.writer, out, self.config.idle_timeout)
                return
            else:
                raise Refused("origin closed before its response was whole", 502, upstream.address)

    def _respond(
        self, guest: h11.Connection, upstream: Upstream, event: h11.Response, masker: Masker | None
    ) -> Decoder | None:
        """Send the guest the response's head; the decoder its body needs to be masked."""
        headers = [(k, v) for k, v in event.headers.raw_items() if k.lower() not in RESPONSE_HOP]
        if _closes(event):
            # The guest's connection ends with the origin's, as it would without us.
            headers.append((b"Connection", b"close"))
        reason, decoder = event.reason, None
        if masker is not None:
            try:
                headers, decoder = masking.screen(masker, event.status_code, headers)
            except Unmaskable as e:
                why = f"origin sent {e}: it could not be searched for echoed secrets"
                raise Refused(why, 502, upstream.address) from None
            reason = masker.mask(reason)
        response = h11.Response(status_code=event.status_code, headers=headers, reason=reason)
        self.writer.write(guest.send(response) or b"")
        return decoder


def _closes(response: h11.Response) -> bool:
    """Whether the origin ends its connection after this response."""
    connection = [v.lower() for k, v in response.headers if k == b"connection"]
    return response.http_version < b"1.1" or any(b"close" in v for v in connection)

"""The gateway: one asyncio process per worker serving every sandbox's DNS and TCP egress.

A sandbox is known by the address its connections come from (the namespace end of its veth
pair; the host's nftables redirect its TCP here and its UDP/53 to the resolver). For each
connection the gateway reads the original destination (SO_ORIGINAL_DST), takes the name from the
TLS SNI or the HTTP Host, checks the policy, resolves the name itself and dials an address that
passes the policy, never the one the guest chose. Without a name only CIDR rules can allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
import struct
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from space.gateway import dns as dns_server
from space.gateway import sniff
from space.gateway.audit import AuditLog
from space.gateway.dns import DNSProtocol, Upstream
from space.gateway.policy import HostRule, IPAddress, Policy, SandboxPolicy
from space.gateway.tls import CertificateAuthority

SO_ORIGINAL_DST = 80
MAX_BODY = 16 * 1024 * 1024
HOP_HEADERS = {"connection", "proxy-connection", "keep-alive", "proxy-authorization"}


@dataclass
class GatewayConfig:
    state_dir: Path  # the CA and the audit file
    upstream_dns: str
    upstream_dns_port: int = 53
    listen_host: str = "0.0.0.0"
    proxy_port: int = 15001
    dns_port: int = 15053
    upstream_ca_file: Path | None = None  # trust for upstream TLS; None: the system's
    connect_timeout: float = 10.0
    peek_timeout: float = 5.0  # how long to wait for a ClientHello or request head
    max_connections: int = 512  # open TCP connections per sandbox; more are refused


@dataclass
class Sandbox:
    id: str
    address: str
    policy: Policy = field(default_factory=Policy)
    connections: int = 0


class Denied(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.audit = AuditLog(config.state_dir / "audit.jsonl")
        self.ca = CertificateAuthority(config.state_dir / "ca")
        self.upstream = Upstream(config.upstream_dns, config.upstream_dns_port)
        self.sandboxes: dict[str, Sandbox] = {}
        self._by_address: dict[str, str] = {}
        self._client_tls = ssl.create_default_context(
            cafile=str(config.upstream_ca_file) if config.upstream_ca_file else None
        )
        self._client_tls.set_alpn_protocols(["http/1.1"])
        self._listener: socket.socket | None = None
        self._dns: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # registry ------------------------------------------------------------------------------

    def set_policy(self, sandbox_id: str, spec: SandboxPolicy) -> None:
        old = self.sandboxes.get(sandbox_id)
        if old is not None and old.address != spec.address:
            self._by_address.pop(old.address, None)
        owner = self._by_address.get(spec.address)
        if owner is not None and owner != sandbox_id:
            self.remove(owner)  # an address is reused only after its sandbox is gone
        if old is not None and old.address == spec.address:
            old.policy = spec.policy  # open connections keep counting against the same limit
        else:
            self.sandboxes[sandbox_id] = Sandbox(sandbox_id, spec.address, spec.policy)
        self._by_address[spec.address] = sandbox_id
        self.audit.record(sandbox_id, "policy", "allow", "policy set", address=spec.address)

    def remove(self, sandbox_id: str) -> bool:
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return False
        self._by_address.pop(sandbox.address, None)
        self.audit.record(sandbox_id, "policy", "deny", "sandbox removed")
        return True

    def sandbox_at(self, address: str) -> Sandbox | None:
        sandbox_id = self._by_address.get(address)
        return None if sandbox_id is None else self.sandboxes.get(sandbox_id)

    # serving -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.listen_host, self.config.proxy_port))
        sock.listen(1024)
        sock.setblocking(False)
        self._listener = sock
        self._spawn(self._accept_loop(sock))
        transport, _ = await loop.create_datagram_endpoint(
            lambda: DNSProtocol(self), local_addr=(self.config.listen_host, self.config.dns_port)
        )
        self._dns = transport

    async def close(self) -> None:
        if self._dns is not None:
            self._dns.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self.audit.close()
        self.ca.close()

    def _spawn(self, coro: object) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(listener)
            except OSError:
                await asyncio.sleep(0.05)  # e.g. out of fds: do not spin
                continue
            conn.setblocking(False)
            self._spawn(self._handle(conn, str(peer[0])))

    async def _handle(self, conn: socket.socket, peer: str) -> None:
        try:
            sandbox = self.sandbox_at(peer)
            if sandbox is None:
                self.audit.record(
                    None, "tcp", "deny", "connection from an unknown address", address=peer
                )
                return
            try:
                raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
            except OSError:
                self.audit.record(sandbox.id, "tcp", "deny", "no original destination")
                return
            port = struct.unpack("!H", raw[2:4])[0]
            dst = ipaddress.ip_address(socket.inet_ntoa(raw[4:8]))
            if sandbox.connections >= self.config.max_connections:
                # One sandbox must not exhaust the gateway's descriptors for all the others.
                reason = f"more than {self.config.max_connections} open connections"
                self.audit.record(sandbox.id, "tcp", "deny", reason, port=port, address=str(dst))
                return
            sandbox.connections += 1
            try:
                await self._serve(sandbox, conn, dst, port)
            finally:
                sandbox.connections -= 1
        except Exception as e:  # one connection's failure must never stop the gateway
            self.audit.record(None, "tcp", "deny", f"internal error: {type(e).__name__}: {e}")
        finally:
            conn.close()

    async def _serve(
        self, sandbox: Sandbox, conn: socket.socket, dst: IPAddress, port: int
    ) -> None:
        policy = sandbox.policy
        if policy.cidr_allows(dst, port):
            # An explicit CIDR rule: the one case where the guest's own address is dialled.
            upstream = await self._dial(sandbox, "tcp", None, [dst], port)
            if upstream is None:
                return
            self.audit.record(sandbox.id, "tcp", "allow", "CIDR rule", port=port, address=str(dst))
            reader, writer = await _guest_streams(conn, None)
            await _splice(reader, writer, upstream[0], upstream[1])
            return
        if port == 53:
            # DNS over TCP (large answers, or a guest's choice): the same resolver and policy.
            reader, writer = await _guest_streams(conn, None)
            await dns_server.serve_tcp(self, sandbox.id, reader, writer)
            return
        kind, name, method = await self._peek(conn)
        if name is None:
            self.audit.record(
                sandbox.id, "tcp", "deny", f"no name ({kind}) and no CIDR rule",
                port=port, address=str(dst),
            )  # fmt: skip
            return
        rule = policy.host_rule(name, port)
        if rule is None:
            self.audit.record(sandbox.id, kind, "deny", "name not allowed on this port", name, port)
            return
        if kind == "http" and method.upper() == "CONNECT":
            self.audit.record(sandbox.id, kind, "deny", "CONNECT is not served", name, port)
            _, writer = await _guest_streams(conn, None)
            await _refuse(writer, "CONNECT is not served")
            return
        addresses = await self._addresses(sandbox, kind, name, port, rule)
        if not addresses:
            return
        if kind == "tls" and not policy.inspects(name, rule):
            upstream = await self._dial(sandbox, kind, name, addresses, port)
            if upstream is None:
                return
            self.audit.record(sandbox.id, kind, "allow", "TLS passed through by SNI", name, port,
                              upstream[2])  # fmt: skip
            reader, writer = await _guest_streams(conn, None)
            await _splice(reader, writer, upstream[0], upstream[1])
            return
        tls = kind == "tls"
        try:
            reader, writer = await _guest_streams(
                conn, self.ca.server_context(name) if tls else None
            )
        except (ssl.SSLError, OSError, TimeoutError) as e:
            self.audit.record(
                sandbox.id, kind, "deny", f"guest TLS handshake failed: {e}", name, port
            )
            return
        await self._http(sandbox, name, port, tls, addresses, reader, writer)

    async def _peek(self, conn: socket.socket) -> tuple[str, str | None, str]:
        """(kind, name, HTTP method) from bytes the guest sent, left unread in the socket."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.config.peek_timeout
        last = b""
        while True:
            # Peeking reads nothing, so the kernel would delay its ACK, and a client with Nagle
            # holds the rest of a two-segment ClientHello until then: 40 ms per connection.
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
            try:
                data: bytes | None = conn.recv(70000, socket.MSG_PEEK)
            except BlockingIOError:
                data = None
            except OSError:
                return "tcp", None, ""
            if data == b"":
                return "tcp", None, ""
            if data and data != last:
                last = data
                try:
                    if data[0] == 0x16:
                        return "tls", _name_or_none(sniff.tls_sni(data)), ""
                    method, host = sniff.http_host(data)
                    return "http", _name_or_none(host), method
                except sniff.Incomplete:
                    pass
                except ValueError:
                    return "unknown protocol", None, ""
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "silent client", None, ""
            if data is None:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(conn.fileno(), _wake, ready)
                try:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ready, remaining)
                finally:
                    loop.remove_reader(conn.fileno())
            else:
                await asyncio.sleep(0.005)  # more of a message that is still arriving

    async def _addresses(
        self, sandbox: Sandbox, kind: str, name: str, port: int, rule: HostRule
    ) -> list[IPAddress]:
        resolved = await self.upstream.addresses(name)
        if not resolved:
            self.audit.record(sandbox.id, kind, "deny", "name does not resolve", name, port)
            return []
        usable = [a for a in resolved if sandbox.policy.dialable(a, rule)]
        if not usable:
            self.audit.record(
                sandbox.id, kind, "deny", "name resolves only to blocked addresses",
                name, port, ",".join(map(str, resolved)),
            )  # fmt: skip
        return usable

    async def _dial(
        self, sandbox: Sandbox, kind: str, name: str | None, addresses: list[IPAddress], port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str] | None:
        error = "no address"
        for address in addresses:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(str(address), port), self.config.connect_timeout
                )
                return reader, writer, str(address)
            except (OSError, TimeoutError) as e:
                error = f"{type(e).__name__}: {e}"
        self.audit.record(sandbox.id, kind, "deny", f"upstream unreachable: {error}", name, port)
        return None

    async def _http(
        self,
        sandbox: Sandbox,
        name: str,
        port: int,
        tls: bool,
        addresses: list[IPAddress],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        """One request, checked and rewritten, then the response; the connection then closes."""
        kind = "https" if tls else "http"
        try:
            try:
                head = await asyncio.wait_for(
                    reader.readuntil(b"\r\n\r\n"), self.config.peek_timeout
                )
                method, target, headers = _parse_head(head)
                _check_request(name, tls, method, target, headers)
                body = await _read_body(reader, headers)
                head_text, injected = _apply_secrets(sandbox.policy, name, tls, head, body)
            except Denied as e:
                self.audit.record(sandbox.id, kind, "deny", e.reason, name, port)
                await _refuse(writer, e.reason)
                return
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    ValueError):  # fmt: skip
                self.audit.record(sandbox.id, kind, "deny", "malformed request", name, port)
                await _refuse(writer, "malformed request", 400)
                return
            upstream = await self._dial(sandbox, kind, name, addresses, port)
            if upstream is None:
                await _refuse(writer, "upstream unreachable", 502)
                return
            up_reader, up_writer, address = upstream
            try:
                if tls:
                    # The upstream certificate must be valid for the same name (no fronting).
                    await up_writer.start_tls(self._client_tls, server_hostname=name)
            except (ssl.SSLError, OSError) as e:
                up_writer.close()
                reason = f"upstream certificate not valid for {name}: {e}"
                self.audit.record(sandbox.id, kind, "deny", reason, name, port, address)
                await _refuse(writer, "upstream certificate rejected", 502)
                return
            why = f"{method} request" + (f"; injected {', '.join(injected)}" if injected else "")
            self.audit.record(sandbox.id, kind, "allow", why, name, port, address)
            up_writer.write(head_text + body)
            values = [sec.value.encode() for sec in sandbox.policy.secrets if sec.name in injected]
            if values:
                await _pipe_masked(up_reader, writer, values)
            else:
                await _pipe(up_reader, writer)
            up_writer.close()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _name_or_none(name: str | None) -> str | None:
    if not name:
        return None
    return name.rstrip(".").lower()


async def _guest_streams(
    conn: socket.socket, tls: ssl.SSLContext | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=65536)
    protocol = asyncio.StreamReaderProtocol(reader)
    dup = conn.dup()  # the transport owns its own fd; `conn` is closed by the caller
    dup.setblocking(False)
    dup.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    transport, _ = await loop.connect_accepted_socket(
        lambda: protocol, dup, ssl=tls, ssl_handshake_timeout=10 if tls else None
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(262144):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError, ssl.SSLError):
        pass


async def _pipe_masked(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, values: list[bytes]
) -> None:
    """Relay a response, overwriting any injected secret the upstream echoes back with `*`s of
    the same length (framing stays valid), so the guest never reads one."""
    keep = max(len(v) for v in values) - 1  # a value may straddle two reads
    pending = b""
    try:
        while True:
            data = await reader.read(262144)
            pending += data
            for value in values:
                pending = pending.replace(value, b"*" * len(value))
            if not data:
                writer.write(pending)
                break
            cut = max(0, len(pending) - keep)
            writer.write(pending[:cut])
            pending = pending[cut:]
            await writer.drain()
        await writer.drain()
    except (OSError, ConnectionError, ssl.SSLError):
        pass


async def _splice(
    g_reader: asyncio.StreamReader,
    g_writer: asyncio.StreamWriter,
    u_reader: asyncio.StreamReader,
    u_writer: asyncio.StreamWriter,
) -> None:
    try:
        await asyncio.gather(_pipe(g_reader, u_writer), _pipe(u_reader, g_writer))
    finally:
        g_writer.close()
        u_writer.close()


async def _refuse(writer: asyncio.StreamWriter, reason: str, status: int = 403) -> None:
    text = f"space gateway: {reason}\n".encode()
    phrase = {400: "Bad Request", 403: "Forbidden", 413: "Content Too Large", 502: "Bad Gateway"}
    writer.write(
        f"HTTP/1.1 {status} {phrase.get(status, 'Error')}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(text)}\r\nConnection: close\r\n\r\n".encode()
        + text
    )
    with contextlib.suppress(Exception):
        await writer.drain()
        writer.close()


def _parse_head(head: bytes) -> tuple[str, str, list[tuple[str, str]]]:
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("bad request line")
    headers = []
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if not sep or not key or key != key.strip():
            raise ValueError("bad header line")
        headers.append((key, value.strip()))
    return parts[0], parts[1], headers


def _check_request(
    name: str, tls: bool, method: str, target: str, headers: list[tuple[str, str]]
) -> None:
    if method.upper() == "CONNECT":
        raise Denied("CONNECT is not served")
    hosts = [v for k, v in headers if k.lower() == "host"]
    if len(hosts) != 1:
        raise Denied("a request needs exactly one Host header")
    host = sniff.strip_port(hosts[0])
    if target.startswith(("http://", "https://")):
        if sniff.strip_port(urllib.parse.urlsplit(target).netloc) != host:
            raise Denied("request target and Host disagree")
    elif not target.startswith("/"):
        raise Denied("request target must be a path")
    if host != name:
        raise Denied(f"Host {host!r} does not match {'SNI' if tls else 'the connection'} {name!r}")
    keys = {k.lower() for k, _ in headers}
    if "transfer-encoding" in keys and "content-length" in keys:
        raise Denied("both Transfer-Encoding and Content-Length (request smuggling)")


async def _read_body(reader: asyncio.StreamReader, headers: list[tuple[str, str]]) -> bytes:
    values = {k.lower(): v for k, v in headers}
    if "transfer-encoding" in values:
        if values["transfer-encoding"].lower() != "chunked":
            raise Denied("unsupported Transfer-Encoding")
        out = bytearray()
        while True:
            line = await reader.readuntil(b"\r\n")
            out += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while (trailer := await reader.readuntil(b"\r\n")) != b"\r\n":
                    out += trailer
                out += b"\r\n"
                return bytes(out)
            if len(out) + size > MAX_BODY:
                raise Denied("request body too large to inspect")
            out += await reader.readexactly(size + 2)
    length = int(values.get("content-length", "0"))
    if length < 0 or length > MAX_BODY:
        raise Denied("request body too large to inspect")
    return await reader.readexactly(length)


def _apply_secrets(
    policy: Policy, name: str, tls: bool, head: bytes, body: bytes
) -> tuple[bytes, list[str]]:
    """The head to send upstream: placeholders swapped, headers injected, hop headers reset.

    Secrets are used only over TLS to a bound host; a placeholder anywhere else is refused.
    """
    request_line, _, fields = head[:-4].decode("latin-1").partition("\r\n")
    injected: list[str] = []
    for secret in policy.secrets:
        if not secret.placeholder:
            continue
        where = [
            part
            for part, found in (
                ("request target", secret.placeholder in request_line),
                ("headers", secret.placeholder in fields),
                ("body", secret.placeholder.encode() in body),
            )
            if found
        ]
        if not where:
            continue
        if not (tls and secret.bound_to(name)):
            raise Denied(f"placeholder of secret {secret.name!r} sent to a host it is not bound to")
        if where != ["headers"]:
            # Swapped into a URL or a body, the value could be stored or echoed by the bound
            # service itself (a search, a paste, an error page): only header values get it.
            raise Denied(f"placeholder of secret {secret.name!r} outside the request headers")
        fields = fields.replace(secret.placeholder, secret.value)
        injected.append(secret.name)
    lines = [request_line, *fields.split("\r\n")]
    out = [lines[0]]
    extra: list[tuple[str, str]] = []
    for secret in policy.secrets:
        header = secret.header_line()
        if header is not None and tls and secret.bound_to(name):
            extra.append(header)
            injected.append(secret.name)
    replaced = {k.lower() for k, _ in extra}
    for line in lines[1:]:
        key = line.partition(":")[0].strip().lower()
        if key not in HOP_HEADERS and key not in replaced:
            out.append(line)
    out += [f"{k}: {v}" for k, v in extra]
    if injected:
        # Compressed, an echoed secret could not be found and masked in the response.
        out = [ln for ln in out if ln.partition(":")[0].strip().lower() != "accept-encoding"]
        out.append("Accept-Encoding: identity")
    out.append("Connection: close")
    return ("\r\n".join(out) + "\r\n\r\n").encode("latin-1"), injected

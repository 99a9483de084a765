"""The gateway: one asyncio process per worker serving every sandbox's DNS and TCP egress.

A sandbox is known by the address its connections come from (the namespace end of its veth
pair; the host's nftables redirect its TCP here and its UDP/53 to the resolver). For each
connection the gateway reads the original destination (SO_ORIGINAL_DST), takes the name from the
TLS SNI or the HTTP Host, checks the policy, resolves the name itself and dials an address that
passes the policy, never the one the guest chose. Without a name only CIDR rules can allow.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import struct
from dataclasses import dataclass, field
from pathlib import Path

from space.gateway import dns as dns_server
from space.gateway import peek, splice
from space.gateway.audit import AuditLog, Limits
from space.gateway.dns import DNSProtocol, Upstream
from space.gateway.heads import Refused
from space.gateway.httpproxy import HttpSession
from space.gateway.limits import Caps
from space.gateway.policy import EgressFloor, HostRule
from space.gateway.sandboxes import Connection, Registry, Sandbox
from space.gateway.tls import CertificateAuthority
from space.networks import IPAddress

SO_ORIGINAL_DST = 80
ACCEPT_BATCH = 256  # connections taken per wake-up of the listening socket


@dataclass
class GatewayConfig:
    state_dir: Path  # the CA (ca/) and the audit files (audit/)
    upstream_dns: str
    upstream_dns_port: int = 53
    listen_host: str = "0.0.0.0"
    proxy_port: int = 15001
    dns_port: int = 15053
    upstream_ca_file: Path | None = None  # trust for upstream TLS; None: the system's
    ca_dir: Path | None = None  # the deployment's CA, which must be there; None: state_dir/ca
    connect_timeout: float = 10.0
    head_timeout: float = 10.0  # a ClientHello (and its handshake), a request head: whole by then
    idle_timeout: float = 60.0  # a body, a splice, a keep-alive connection: closed if nothing moves
    max_connections: int = 512  # open TCP connections per sandbox (at most half the total)
    max_total_connections: int = 8192  # all sandboxes together
    dns_rate: float = 100.0  # queries a second per sandbox, on average; REFUSED beyond
    dns_burst: int = 200
    audit: Limits = field(default_factory=Limits)  # rings in memory, rotation on disk
    floor: EgressFloor = field(default_factory=EgressFloor)  # what no policy opens


class Gateway(Registry):
    def __init__(self, config: GatewayConfig) -> None:
        audit = AuditLog(config.state_dir / "audit" / "audit.jsonl", config.audit)
        super().__init__(audit, config.dns_rate, config.dns_burst)
        self.config = config
        self.caps = Caps(config.max_connections, config.max_total_connections)
        if config.ca_dir is not None:
            self.ca = CertificateAuthority(config.ca_dir, make=False)
        else:
            self.ca = CertificateAuthority(config.state_dir / "ca")
        self.upstream = Upstream(config.upstream_dns, config.upstream_dns_port)
        self.client_tls = ssl.create_default_context(
            cafile=str(config.upstream_ca_file) if config.upstream_ca_file else None
        )
        self.client_tls.set_alpn_protocols(["http/1.1"])
        self._listener: socket.socket | None = None
        self._dns: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # serving -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.listen_host, self.config.proxy_port))
        sock.listen(1024)
        sock.setblocking(False)
        self._listener = sock
        loop.add_reader(sock.fileno(), self._accept)
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
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        self.audit.close()
        self.ca.close()

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _accept(self) -> None:
        """Take every connection waiting (up to a batch) and admit or refuse each at once: a
        refused one costs no task, so a flood of them is cheap for the others."""
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError:  # e.g. out of descriptors: wait a little rather than spin
                loop = asyncio.get_running_loop()
                loop.remove_reader(self._listener.fileno())
                loop.call_later(0.05, loop.add_reader, self._listener.fileno(), self._accept)
                return
            try:
                admitted = self._admit(conn, str(peer[0]))
            except Exception as e:  # one connection's failure must never stop the gateway
                self.audit.record(None, "tcp", "deny", f"internal error: {type(e).__name__}: {e}")
                admitted = None
            if admitted is None:
                conn.close()
                continue
            sandbox, connection = admitted
            connection.task = self._spawn(self._handle(sandbox, connection, conn))

    def _admit(self, conn: socket.socket, peer: str) -> tuple[Sandbox, Connection] | None:
        sandbox = self.sandbox_at(peer)
        if sandbox is None:
            self.audit.record(
                None, "tcp", "deny", "connection from an unknown address", address=peer
            )
            return None
        try:
            raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
        except OSError:
            self.audit.record(sandbox.id, "tcp", "deny", "no original destination")
            return None
        port = struct.unpack("!H", raw[2:4])[0]
        dst = ipaddress.ip_address(socket.inet_ntoa(raw[4:8]))
        refusal = self.caps.refusal(len(sandbox.connections), self.open, self.active)
        if refusal is not None:
            if sandbox.refusals.first():  # the rest of this run are counted, not logged
                reason = f"{refusal}; refused until it holds fewer"
                self.audit.record(sandbox.id, "tcp", "deny", reason, port=port, address=str(dst))
            return None
        sandbox.refusals.end()
        connection = Connection(dst, port)
        self.track(sandbox, connection)
        conn.setblocking(False)
        return sandbox, connection

    async def _handle(self, sandbox: Sandbox, connection: Connection, conn: socket.socket) -> None:
        try:
            await self._serve(sandbox, connection, conn)
        except Exception as e:  # one connection's failure must never stop the gateway
            self.audit.record(None, "tcp", "deny", f"internal error: {type(e).__name__}: {e}")
        finally:
            self.untrack(sandbox, connection)
            conn.close()

    async def _serve(self, sandbox: Sandbox, connection: Connection, conn: socket.socket) -> None:
        dst, port = connection.dst, connection.port
        policy = sandbox.policy
        if policy.cidr_allows(dst, port, self.config.floor):
            # An explicit CIDR rule: the one case where the guest's own address is dialled.
            connection.cidr = True
            try:
                up_reader, up_writer, address = await self.dial(sandbox, None, [dst], port)
            except Refused as e:
                self._deny(sandbox, "tcp", e, None, port)
                return
            self.audit.record(sandbox.id, "tcp", "allow", "CIDR rule", port=port, address=address)
            await self._splice(sandbox, connection, "tcp", conn, (up_reader, up_writer))
            return
        if port == 53:
            # DNS over TCP (large answers, or a guest's choice): the same resolver and policy.
            reader, writer = await splice.guest_streams(conn, None, self.config.head_timeout)
            await dns_server.serve_tcp(self, sandbox, reader, writer)
            return
        kind, name = await peek.first_bytes(conn, self.config.head_timeout)
        if kind == "http":
            streams = await splice.guest_streams(conn, None, self.config.head_timeout)
            await HttpSession(self, sandbox, connection, False, None, [], streams).run()
            return
        if name is None:
            self.audit.record(
                sandbox.id, "tcp", "deny", f"no name ({kind}) and no CIDR rule",
                port=port, address=str(dst),
            )  # fmt: skip
            return
        try:
            rule, addresses = await self.route(sandbox, connection, kind, name)
            passthrough = connection.passthrough = not sandbox.policy.inspects(name, rule)
            upstream = await self.dial(sandbox, name, addresses, port) if passthrough else None
        except Refused as e:
            self._deny(sandbox, kind, e, name, port)
            return
        if upstream is not None:
            self.audit.record(sandbox.id, kind, "allow", "TLS passed through by SNI", name, port,
                              upstream[2])  # fmt: skip
            await self._splice(sandbox, connection, kind, conn, upstream[:2])
            return
        try:
            streams = await splice.guest_streams(
                conn, self.ca.server_context(name), self.config.head_timeout
            )
        except (ssl.SSLError, OSError, TimeoutError) as e:
            self.audit.record(
                sandbox.id, kind, "deny", f"guest TLS handshake failed: {e}", name, port
            )
            return
        await HttpSession(self, sandbox, connection, True, name, addresses, streams).run()

    async def _splice(
        self,
        sandbox: Sandbox,
        connection: Connection,
        kind: str,
        conn: socket.socket,
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        try:
            guest = await splice.guest_streams(conn, None, self.config.head_timeout)
        except BaseException:
            splice.close(upstream[1])
            raise
        if not await splice.splice(guest, upstream, self.config.idle_timeout, connection):
            reason = f"closed: nothing moved for {self.config.idle_timeout:g} s"
            self.audit.record(sandbox.id, kind, "deny", reason, connection.name, connection.port)

    def _deny(self, sandbox: Sandbox, kind: str, e: Refused, name: str | None, port: int) -> None:
        self.audit.record(sandbox.id, kind, "deny", e.reason, name, port, e.address)

    async def route(
        self, sandbox: Sandbox, connection: Connection, kind: str, name: str
    ) -> tuple[HostRule, list[IPAddress]]:
        """The rule that lets `name` through on the connection's port, and the addresses it may
        be dialled at (resolved by the gateway); Refused if there are none."""
        port = connection.port
        policy = sandbox.policy
        rule = policy.host_rule(name, port)
        if rule is None:
            raise Refused("name not allowed on this port")
        addresses = await self._addresses(sandbox, kind, name, port, rule)
        connection.bind(policy, name, rule)
        if sandbox.policy is not policy and not connection.allowed_under(sandbox.policy):
            raise Refused("the policy changed while it was routed")
        return rule, addresses

    async def _addresses(
        self, sandbox: Sandbox, kind: str, name: str, port: int, rule: HostRule
    ) -> list[IPAddress]:
        resolved = await self.upstream.addresses(name)
        if not resolved:
            raise Refused("name does not resolve")
        usable = [a for a in resolved if sandbox.policy.dialable(a, rule, self.config.floor)]
        if not usable:
            raise Refused(
                "name resolves only to blocked addresses", address=",".join(map(str, resolved))
            )
        return usable

    async def dial(
        self, sandbox: Sandbox, name: str | None, addresses: list[IPAddress], port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
        error = "no address"
        for address in addresses:
            try:
                reader, writer = await splice.open_stream(
                    str(address), port, self.config.connect_timeout
                )
                return reader, writer, str(address)
            except (OSError, TimeoutError) as e:
                error = f"{type(e).__name__}: {e}"
        raise Refused(f"upstream unreachable: {error}", 502)

"""The sandboxes' resolver: answers only names their policy allows, from the configured upstream.

A name that is not allowed is REFUSED and never sent upstream (no exfiltration in query names).
AAAA questions get an empty answer: guests have no IPv6 egress. A and AAAA records in blocked
networks are stripped unless the policy allows them (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import TYPE_CHECKING

import dns.asyncquery
import dns.asyncresolver
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.resolver
import dns.rrset

from space.gateway.policy import normalize_name
from space.networks import IPAddress

if TYPE_CHECKING:
    from space.gateway.sandboxes import Sandbox
    from space.gateway.server import Gateway

ANSWERED_TYPES = {dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.CNAME}
MAX_PENDING = 32  # a sandbox's queries waiting on the upstream at once
MAX_UPSTREAM = 256  # the gateway's, all sandboxes together (each holds a socket)


class Upstream:
    """The gateway's own resolution of allowed names (cached by TTL)."""

    def __init__(self, host: str, port: int = 53, timeout: float = 3.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.resolver = dns.asyncresolver.Resolver(configure=False)
        self.resolver.nameservers = [host]
        self.resolver.port = port
        self.resolver.lifetime = timeout
        self.resolver.cache = dns.resolver.Cache()
        self._slots = asyncio.Semaphore(MAX_UPSTREAM)

    async def addresses(self, name: str) -> list[IPAddress]:
        try:
            async with self._slots:
                answer = await self.resolver.resolve(name, "A")
        except (dns.exception.DNSException, OSError):
            return []
        return [ipaddress.ip_address(r.to_text()) for r in answer]

    async def forward(self, query: dns.message.Message) -> dns.message.Message:
        # A truncated answer is fetched again over TCP, so guests get it whole.
        async with self._slots:
            reply, _ = await dns.asyncquery.udp_with_fallback(
                query, self.host, timeout=self.timeout, port=self.port
            )
        return reply


class DNSProtocol(asyncio.DatagramProtocol):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(data, addr))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        sandbox = self.gateway.sandbox_at(str(addr[0]))
        audit = self.gateway.audit
        if sandbox is None:
            audit.record(None, "dns", "deny", "query from an unknown address", address=str(addr[0]))
            return
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            audit.record(sandbox.id, "dns", "deny", "malformed query")
            return
        reply = await budgeted(self.gateway, sandbox, query)
        if self.transport is not None:
            # Over UDP an answer too large for the query's buffer is cut; TCP gets it whole.
            self.transport.sendto(reply.to_wire(max_size=max(512, query.payload)), addr)


async def serve_tcp(
    gateway: Gateway, sandbox: Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """DNS over TCP (RFC 7766): length-prefixed queries, answered like UDP ones."""
    try:
        while True:
            try:
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(2), 10), "big")
                query = dns.message.from_wire(await reader.readexactly(size))
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            except dns.exception.DNSException:
                gateway.audit.record(sandbox.id, "dns", "deny", "malformed query over TCP")
                return
            wire = (await budgeted(gateway, sandbox, query)).to_wire()
            writer.write(len(wire).to_bytes(2, "big") + wire)
            await writer.drain()
    finally:
        writer.close()


async def budgeted(
    gateway: Gateway, sandbox: Sandbox, query: dns.message.Message
) -> dns.message.Message:
    """The reply to a query, or REFUSED while the sandbox is over its rate (or has too many
    queries waiting on the upstream): a flood must not slow its neighbours' lookups."""
    if sandbox.dns_pending >= MAX_PENDING or not sandbox.dns.take():
        if sandbox.dns_refusals.first():  # once per run of refusals, not per query
            reason = (f"over {sandbox.dns.rate:g} queries/s (bursts of {sandbox.dns.burst}): "
                      "REFUSED until it slows down")  # fmt: skip
            gateway.audit.record(sandbox.id, "dns", "deny", reason)
        reply = dns.message.make_response(query)
        reply.set_rcode(dns.rcode.REFUSED)
        return reply
    if sandbox.dns.full:
        sandbox.dns_refusals.end()  # back under its rate for a while: a new run is logged again
    sandbox.dns_pending += 1
    try:
        return await answer(gateway, sandbox.id, query)
    finally:
        sandbox.dns_pending -= 1


async def answer(
    gateway: Gateway, sandbox_id: str, query: dns.message.Message
) -> dns.message.Message:
    """The reply to a sandbox's query under its policy (every decision audited)."""
    audit = gateway.audit
    policy = gateway.sandboxes[sandbox_id].policy
    reply = dns.message.make_response(query)
    reply.flags |= dns.flags.RA
    if len(query.question) != 1:
        reply.set_rcode(dns.rcode.FORMERR)
        return reply
    question = query.question[0]
    name = normalize_name(question.name.to_text())
    if not policy.name_allowed(name):
        audit.record(sandbox_id, "dns", "deny", "name not allowed", host=name)
        reply.set_rcode(dns.rcode.REFUSED)
        return reply
    if question.rdtype == dns.rdatatype.AAAA:
        return reply  # no data: guests have no IPv6 egress
    if question.rdtype not in ANSWERED_TYPES:
        audit.record(sandbox_id, "dns", "deny", "query type not served", host=name)
        reply.set_rcode(dns.rcode.REFUSED)
        return reply
    try:
        upstream = await gateway.upstream.forward(query)
    except (dns.exception.DNSException, OSError) as e:
        audit.record(sandbox_id, "dns", "deny", f"upstream failed: {type(e).__name__}", name)
        reply.set_rcode(dns.rcode.SERVFAIL)
        return reply
    rule = policy.host_rule(name, 443) or policy.host_rule(name, 80)
    floor = gateway.config.floor
    reply.set_rcode(upstream.rcode())
    stripped = False
    for rrset in upstream.answer:
        if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            keep = [
                r for r in rrset if policy.dialable(ipaddress.ip_address(r.to_text()), rule, floor)
            ]
            stripped |= len(keep) != len(rrset)
            if not keep:
                continue
            rrset = dns.rrset.from_rdata_list(rrset.name, rrset.ttl, keep)
        reply.answer.append(rrset)
    reason = "allowed; blocked addresses stripped" if stripped else "allowed"
    audit.record(sandbox_id, "dns", "allow", reason, host=name)
    return reply

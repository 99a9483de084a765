"""The sandboxes a gateway serves: which is at which address, under which policy, holding which
connections. A policy change closes the connections it no longer allows, and removing a
sandbox closes all of its connections, at once."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from space.gateway.audit import AuditLog
from space.gateway.limits import Burst, TokenBucket
from space.gateway.policy import HostRule, Policy, SandboxPolicy, Secret
from space.networks import IPAddress


@dataclass(eq=False)
class Connection:
    """One guest connection, and what it was let through for."""

    dst: IPAddress  # the guest's original destination
    port: int
    task: asyncio.Task[None] | None = None  # what serves it (set once it is admitted)
    cidr: bool = False  # let through by a CIDR rule, to `dst` itself
    name: str | None = None  # the name it was routed by (None: not yet, or DNS over TCP)
    rule: HostRule | None = None
    passthrough: bool | None = None  # TLS spliced (True) or terminated (False); None: not TLS
    secrets: tuple[Secret, ...] = ()  # bound to `name` when routed (injected, masked)
    allow_networks: tuple[str, ...] = ()
    sent: int = 0  # bytes that went to the origin (as the gateway wrote them upstream)
    received: int = 0  # bytes that came back from it

    @property
    def host(self) -> str:
        """What its bytes are counted under: the name it was routed by, or the address."""
        return self.name or str(self.dst)

    def bind(self, policy: Policy, name: str, rule: HostRule) -> None:
        self.name, self.rule = name, rule
        self.secrets = _bound(policy, name)
        self.allow_networks = tuple(policy.allow_networks)

    def allowed_under(self, policy: Policy) -> bool:
        """Whether `policy` lets this connection through as it was let through: the same
        rule, secrets and TLS treatment (the gateway's floor does not change while it runs)."""
        if self.cidr:
            return any(rule.matches(self.dst, self.port) for rule in policy.cidrs)
        if self.name is None or self.rule is None:
            return True  # routed later, by the policy in force then; DNS is checked per query
        rule = policy.host_rule(self.name, self.port)
        if rule is None or rule.allow_private != self.rule.allow_private:
            return False
        if tuple(policy.allow_networks) != self.allow_networks:
            return False
        if self.passthrough is not None and self.passthrough == policy.inspects(self.name, rule):
            return False
        return _bound(policy, self.name) == self.secrets


def _bound(policy: Policy, name: str) -> tuple[Secret, ...]:
    return tuple(s for s in policy.secrets if s.bound_to(name))


# Hosts whose bytes a sandbox's counts keep apart; any further ones are counted together (a
# guest naming a new host a second must not grow what metering reads and keeps).
MAX_HOSTS = 100
OTHER_HOSTS = "(other hosts)"


@dataclass(eq=False)
class Sandbox:
    id: str
    address: str
    policy: Policy
    dns: TokenBucket
    connections: set[Connection] = field(default_factory=set)
    refusals: Burst = field(default_factory=Burst)  # connections over its caps
    dns_refusals: Burst = field(default_factory=Burst)  # queries over its rate
    dns_pending: int = 0  # its queries waiting on the upstream
    # Bytes (sent, received) by host of its connections that ended; `traffic()` adds the open.
    ended: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Which run of counts these are: a sandbox taken on again (the gateway restarted, the
    # sandbox came back to another address) counts from zero under a new epoch.
    epoch: str = field(default_factory=lambda: secrets.token_hex(6))

    def count(self, connection: Connection) -> None:
        if connection.sent or connection.received:
            _add(self.ended, connection.host, connection.sent, connection.received)

    def traffic(self) -> dict[str, tuple[int, int]]:
        """Bytes (sent, received) by host since the gateway took it on: they only grow."""
        counts = dict(self.ended)
        for c in self.connections:
            _add(counts, c.host, c.sent, c.received)
        return counts


def _add(counts: dict[str, tuple[int, int]], host: str, sent: int, received: int) -> None:
    if host not in counts and len(counts) >= MAX_HOSTS:
        host = OTHER_HOSTS
    before = counts.get(host, (0, 0))
    counts[host] = (before[0] + sent, before[1] + received)


class Registry:
    def __init__(self, audit: AuditLog, dns_rate: float, dns_burst: int) -> None:
        self.audit = audit
        self.sandboxes: dict[str, Sandbox] = {}
        self._by_address: dict[str, str] = {}
        self._dns_rate, self._dns_burst = dns_rate, dns_burst
        self.open = 0  # connections, all sandboxes together

    def set_policy(self, sandbox_id: str, spec: SandboxPolicy) -> None:
        old = self.sandboxes.get(sandbox_id)
        owner = self._by_address.get(spec.address)
        if owner is not None and owner != sandbox_id:
            self.remove(owner)  # an address is reused only after its sandbox is gone
        if old is not None and old.address == spec.address:
            old.policy = spec.policy  # open connections keep counting against the same caps
            revoked = [c for c in old.connections if not c.allowed_under(spec.policy)]
            self._close(old, revoked, "the policy no longer allows them")
        else:
            if old is not None:
                self._by_address.pop(old.address, None)
                self._close(old, list(old.connections), "the sandbox moved to another address")
            bucket = TokenBucket(self._dns_rate, self._dns_burst)
            self.sandboxes[sandbox_id] = Sandbox(sandbox_id, spec.address, spec.policy, bucket)
        self._by_address[spec.address] = sandbox_id
        self.audit.record(sandbox_id, "policy", "allow", "policy set", address=spec.address)

    def remove(self, sandbox_id: str) -> bool:
        sandbox = self.sandboxes.pop(sandbox_id, None)
        if sandbox is None:
            return False
        self._by_address.pop(sandbox.address, None)
        self._close(sandbox, list(sandbox.connections), "the sandbox was removed")
        self.audit.record(sandbox_id, "policy", "deny", "sandbox removed")
        return True

    def sandbox_at(self, address: str) -> Sandbox | None:
        sandbox_id = self._by_address.get(address)
        return None if sandbox_id is None else self.sandboxes.get(sandbox_id)

    def active(self) -> int:
        """How many sandboxes hold connections."""
        return sum(1 for s in self.sandboxes.values() if s.connections)

    def track(self, sandbox: Sandbox, connection: Connection) -> None:
        sandbox.connections.add(connection)
        self.open += 1

    def untrack(self, sandbox: Sandbox, connection: Connection) -> None:
        sandbox.connections.discard(connection)
        sandbox.count(connection)
        self.open -= 1

    def _close(self, sandbox: Sandbox, connections: list[Connection], why: str) -> None:
        if not connections:
            return
        for connection in connections:
            if connection.task is not None:
                connection.task.cancel()  # its handler closes both ends on the way out
        names = sorted({c.name or str(c.dst) for c in connections})
        reason = f"{len(connections)} connection(s) closed: {why} ({', '.join(names[:10])})"
        self.audit.record(sandbox.id, "tcp", "deny", reason)

"""What a sandbox may reach: host rules, CIDR rules, bound secrets. Pushed by the worker."""

from __future__ import annotations

import ipaddress
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from space.networks import (
    NEVER_NETWORKS,
    PRIVATE_NETWORKS,
    IPAddress,
    IPNetwork,
    openable,
    plain,
    within,
)


class EgressFloor(BaseModel):
    """What no sandbox policy can open, set by the operator: `open_networks` are the private
    networks sandboxes may be given (none by default); `closed_networks` are the worker's own
    ranges (sandbox links), never dialled even inside an open network."""

    open_networks: list[str] = Field(default_factory=list)
    closed_networks: list[str] = Field(default_factory=list)

    @field_validator("open_networks", "closed_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(n, strict=False)) for n in v]

    @field_validator("open_networks")
    @classmethod
    def _openable(cls, v: list[str]) -> list[str]:
        return openable(v)

    # Parsed once: `permits` runs for every dial and every address of every DNS answer.
    @cached_property
    def _open(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(n) for n in self.open_networks]

    @cached_property
    def _closed(self) -> list[IPNetwork]:
        return [ipaddress.ip_network(n) for n in self.closed_networks]

    def never(self, address: IPAddress) -> bool:
        address = plain(address)
        return any(address in net for net in (*NEVER_NETWORKS, *self._closed))

    def permits(self, address: IPAddress, private_ok: bool) -> bool:
        """May the gateway dial `address`? `private_ok`: the sandbox's policy asks for it."""
        address = plain(address)
        if self.never(address):
            return False
        if not any(address in net for net in PRIVATE_NETWORKS):
            return True
        return private_ok and any(address in net for net in self._open)

    def refusal(self, network: str, private: bool) -> str | None:
        """Why a policy naming `network` is refused, or None. `private`: it is asked for as a
        private network (allow_networks), not as a CIDR rule that may also hold public space."""
        net = ipaddress.ip_network(network, strict=False)
        if within(net, [*NEVER_NETWORKS, *self._closed]):
            return f"{net} is loopback, link-local (cloud metadata) or reserved: never reachable"
        if within(net, self._open):
            return None
        if private or within(net, [*NEVER_NETWORKS, *PRIVATE_NETWORKS, *self._closed]):
            opened = ", ".join(self.open_networks) or "none"
            return (
                f"{net} is private and not opened by the operator "
                f"(SPACE_EGRESS_OPEN_NETWORKS: {opened})"
            )
        return None

    def refusals(self, policy: Policy) -> list[str]:
        """Every part of `policy` this floor refuses, each with its reason."""
        out = []
        for i, rule in enumerate(policy.cidrs):
            if (why := self.refusal(rule.cidr, private=False)) is not None:
                out.append(f"cidrs[{i}]: {why}")
        for i, n in enumerate(policy.allow_networks):
            if (why := self.refusal(n, private=True)) is not None:
                out.append(f"allow_networks[{i}]: {why}")
        if not self.open_networks:
            out += [
                f"hosts[{i}].allow_private: the operator opened no private network"
                for i, rule in enumerate(policy.hosts)
                if rule.allow_private
            ]
        return out


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


class HostRule(BaseModel):
    """`pattern`: `example.com` (that name only) or `*.example.com` (its subdomains)."""

    pattern: str
    ports: list[int] = Field(default_factory=lambda: [80, 443])
    # passthrough: TLS spliced by SNI; inspect: terminated with the deployment CA; auto: inspect
    # only if a secret is bound to the host or the sandbox has placeholders to guard.
    tls: Literal["auto", "passthrough", "inspect"] = "auto"
    allow_private: bool = False  # may resolve to a private network the operator opened

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v: str) -> str:
        v = normalize_name(v)
        if not v or " " in v or "*" in v.removeprefix("*."):
            raise ValueError(f"bad host pattern {v!r}: use name or *.name")
        return v

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("*."):
            return name.endswith(self.pattern[1:])
        return name == self.pattern


class CidrRule(BaseModel):
    """Raw TCP to these addresses (by IP, no name needed); `ports` empty means any port."""

    cidr: str
    ports: list[int] = Field(default_factory=list)

    @field_validator("cidr")
    @classmethod
    def _cidr(cls, v: str) -> str:
        return str(ipaddress.ip_network(v, strict=False))

    def matches(self, address: IPAddress, port: int) -> bool:
        return address in ipaddress.ip_network(self.cidr) and (not self.ports or port in self.ports)


class Secret(BaseModel):
    """A credential the guest never sees, used only on requests to `hosts` (patterns)."""

    name: str
    value: str
    hosts: list[str]
    header: str | None = None  # add this header (value from `header_value`) on bound hosts
    header_value: str = "{value}"
    placeholder: str | None = None  # the guest's stand-in, swapped for `value` on bound hosts

    def bound_to(self, name: str) -> bool:
        return any(HostRule(pattern=p).matches(name) for p in self.hosts)

    def header_line(self) -> tuple[str, str] | None:
        if self.header is None:
            return None
        return self.header, self.header_value.replace("{value}", self.value)


class Policy(BaseModel):
    default: Literal["deny", "allow"] = "deny"  # allow: any name (still rebinding-checked)
    hosts: list[HostRule] = Field(default_factory=list)
    cidrs: list[CidrRule] = Field(default_factory=list)
    secrets: list[Secret] = Field(default_factory=list)
    allow_networks: list[str] = Field(default_factory=list)  # private networks it may reach

    def host_rule(self, name: str, port: int) -> HostRule | None:
        for rule in self.hosts:
            if rule.matches(name) and port in rule.ports:
                return rule
        if self.default == "allow":
            return HostRule(pattern=name, ports=[port])
        return None

    def name_allowed(self, name: str) -> bool:
        return self.default == "allow" or any(rule.matches(name) for rule in self.hosts)

    def dialable(self, address: IPAddress, rule: HostRule | None, floor: EgressFloor) -> bool:
        """May a name (under `rule`) that resolved to `address` be dialled? Public addresses
        yes; private ones where the policy asks and the operator opened them; never the rest."""
        private_ok = (rule is not None and rule.allow_private) or any(
            plain(address) in ipaddress.ip_network(n) for n in self.allow_networks
        )
        return floor.permits(address, private_ok)

    def cidr_allows(self, address: IPAddress, port: int, floor: EgressFloor) -> bool:
        """A raw connection by IP: a CIDR rule names it, and the floor lets it through (a rule
        is its own ask for a private address)."""
        return any(rule.matches(address, port) for rule in self.cidrs) and floor.permits(
            address, private_ok=True
        )

    def inspects(self, name: str, rule: HostRule) -> bool:
        if rule.tls != "auto":
            return rule.tls == "inspect"
        if any(s.bound_to(name) for s in self.secrets):
            return True
        return any(s.placeholder for s in self.secrets)


class SandboxPolicy(BaseModel):
    """What the worker pushes: the sandbox's address as the gateway sees it, and its policy."""

    address: str  # the namespace end of its veth pair
    policy: Policy

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        return str(ipaddress.ip_address(v))

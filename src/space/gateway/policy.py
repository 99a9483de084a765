"""What a sandbox may reach: host rules, CIDR rules, bound secrets. Pushed by the worker."""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, Field, field_validator

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Never dialled after resolution unless a policy names them (DNS rebinding, metadata, the host).
BLOCKED_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
        "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/4",
        "240.0.0.0/4", "::/127", "::ffff:0:0/96", "64:ff9b::/96", "fc00::/7", "fe80::/10",
        "ff00::/8",
    )
)  # fmt: skip


def normalize_name(name: str) -> str:
    return name.strip().rstrip(".").lower()


class HostRule(BaseModel):
    """`pattern`: `example.com` (that name only) or `*.example.com` (its subdomains)."""

    pattern: str
    ports: list[int] = Field(default_factory=lambda: [80, 443])
    # passthrough: TLS spliced by SNI; inspect: terminated with the deployment CA; auto: inspect
    # only if a secret is bound to the host or the sandbox has placeholders to guard.
    tls: Literal["auto", "passthrough", "inspect"] = "auto"
    allow_private: bool = False  # may resolve to a blocked network (an internal service)

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
    allow_networks: list[str] = Field(default_factory=list)  # exempt from BLOCKED_NETWORKS

    def host_rule(self, name: str, port: int) -> HostRule | None:
        for rule in self.hosts:
            if rule.matches(name) and port in rule.ports:
                return rule
        if self.default == "allow":
            return HostRule(pattern=name, ports=[port])
        return None

    def name_allowed(self, name: str) -> bool:
        return self.default == "allow" or any(rule.matches(name) for rule in self.hosts)

    def cidr_allows(self, address: IPAddress, port: int) -> bool:
        return any(rule.matches(address, port) for rule in self.cidrs)

    def dialable(self, address: IPAddress, rule: HostRule | None) -> bool:
        """False for blocked networks (after resolution), unless the policy allows them."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not any(address in net for net in BLOCKED_NETWORKS):
            return True
        if rule is not None and rule.allow_private:
            return True
        return any(address in ipaddress.ip_network(n) for n in self.allow_networks)

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

"""Address ranges a sandbox's egress is judged by: what is never dialled, what is private, and
what an operator may open. Standard library only: settings read these at every start."""

from __future__ import annotations

import ipaddress

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Never dialled, whatever a policy says: this host and its loopback, link-local (the cloud
# metadata service, 169.254.169.254), "this network", multicast, reserved, NAT64 (which maps onto
# any of them). `EgressFloor` adds the sandboxes' own ranges.
NEVER_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4", "::/127",
        "64:ff9b::/96", "fe80::/10", "ff00::/8",
        # IPv6 forms that carry an IPv4 address a host may route to it (IPv4-compatible and
        # -translated, local NAT64, 6to4, Teredo), and the old site-local range.
        "::/96", "::ffff:0:0:0/96", "64:ff9b:1::/48", "2002::/16", "2001::/32", "fec0::/10",
    )
)  # fmt: skip
# Private and shared ranges: dialled only where the operator opened them (an internal service)
# and the sandbox's policy asks for them.
PRIVATE_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.0.0.0/24", "192.168.0.0/16",
        "198.18.0.0/15", "fc00::/7",
    )
)  # fmt: skip


# Every worker's sandbox links come from here (a /16 each): no sandbox reaches another's.
SANDBOX_RANGES = ipaddress.IPv4Network("10.128.0.0/10")


def plain(address: IPAddress) -> IPAddress:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def within(net: IPNetwork, others: tuple[IPNetwork, ...] | list[IPNetwork]) -> bool:
    return any(net.version == o.version and net.subnet_of(o) for o in others)  # type: ignore[arg-type]


def overlaps(net: IPNetwork, others: tuple[IPNetwork, ...] | list[IPNetwork]) -> bool:
    return any(net.version == o.version and net.overlaps(o) for o in others)


def openable(networks: list[str]) -> list[str]:
    """Networks an operator may open to sandboxes, normalised; ValueError for any other."""
    out = []
    for n in networks:
        net = ipaddress.ip_network(n, strict=False)  # ValueError names what does not parse
        if overlaps(net, NEVER_NETWORKS):
            raise ValueError(f"{net} holds loopback, link-local or reserved addresses")
        out.append(str(net))
    return out

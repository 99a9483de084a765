"""Each sandbox's network: a namespace, a tap for the guest, a veth pair to the host, nftables.

The guest always sees the same addresses (rules.GUEST_IP behind rules.GATEWAY_IP), so a snapshot
restores anywhere without re-addressing; only the veth pair's addresses differ per sandbox. Names
are derived from the sandbox id, so `destroy` needs no state and works after a crash, and `sweep`
removes whatever a dead worker left behind by name prefix.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import hashlib
import ipaddress
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute  # type: ignore[import-untyped]
from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]

from space.worker.network import netns, rules
from space.worker.network.rules import NetworkError

_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TUNSETIFF = 0x400454CA
TUNSETPERSIST = 0x400454CB
TUNGETIFF = 0x800454D2
TUNGETDEVNETNS = 0x54E3
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000


@dataclass(frozen=True)
class NetworkConfig:
    """Per worker. Tests use their own prefixes, table and ports so they never meet a worker's."""

    host_range: str = "10.200.0.0/16"  # carved into one /30 per sandbox
    link_prefix: str = "sp-"  # host veth names: prefix + 10 hex digits of the id's hash
    netns_prefix: str = "space-"
    table: str = "space_gateway"
    proxy_port: int = 15001  # the gateway's transparent TCP port on the host
    dns_port: int = 15053  # the gateway's resolver on the host
    rate_mbit: int = 0  # each sandbox's bandwidth, each way (0: no limit)


@dataclass(frozen=True)
class SandboxNetwork:
    sandbox_id: str
    netns: str
    host_link: str
    host_ip: str  # host end of the veth pair
    sandbox_ip: str  # namespace end: the gateway sees the sandbox's connections come from here
    guest_ip: str = rules.GUEST_IP
    gateway_ip: str = rules.GATEWAY_IP
    guest_mac: str = rules.GUEST_MAC
    tap: str = rules.GUEST_LINK

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class NetworkManager:
    """Creates, adopts and destroys sandbox networks; owns the host's nftables table."""

    def __init__(self, config: NetworkConfig | None = None) -> None:
        self.config = config or NetworkConfig()
        self._range = ipaddress.IPv4Network(self.config.host_range)
        self._slots = self._range.num_addresses // 4
        self._used: dict[int, str] = {}  # slot → sandbox id
        self._lock = asyncio.Lock()

    # names -----------------------------------------------------------------------------

    def netns_name(self, sandbox_id: str) -> str:
        _check_id(sandbox_id)
        return self.config.netns_prefix + sandbox_id

    def host_link_name(self, sandbox_id: str) -> str:
        _check_id(sandbox_id)
        return self.config.link_prefix + hashlib.sha256(sandbox_id.encode()).hexdigest()[:10]

    def _addresses(self, slot: int) -> tuple[str, str]:
        base = self._range.network_address + 4 * slot
        return str(base + 1), str(base + 2)

    def _slot_of(self, host_ip: str) -> int:
        return (int(ipaddress.IPv4Address(host_ip)) - int(self._range.network_address)) // 4

    # lifecycle ---------------------------------------------------------------------------

    async def start(self, keep: Iterable[str] = ()) -> list[SandboxNetwork]:
        """Load the host rules, adopt the networks of sandboxes in `keep`, remove all others."""
        c = self.config
        ruleset = rules.host_ruleset(
            c.table, c.link_prefix + "*", c.host_range, c.proxy_port, c.dns_port
        )
        await asyncio.to_thread(rules.nft, ruleset)
        keep = set(keep)
        await self.sweep(keep)
        adopted = []
        for sandbox_id in sorted(keep):
            net = await self.adopt(sandbox_id)
            if net is not None:
                adopted.append(net)
        return adopted

    async def stop(self) -> None:
        """Remove the host table (sandbox networks stay: VMs outlive the worker)."""
        await asyncio.to_thread(
            rules.nft, f"table inet {self.config.table}\ndelete table inet {self.config.table}\n"
        )

    async def create(self, sandbox_id: str, guest_veth_netns: str | None = None) -> SandboxNetwork:
        """Build the sandbox's network; on any failure nothing is left behind.

        `guest_veth_netns`: instead of a tap, give the guest side as a veth whose peer `eth0` is
        put in that namespace (tests use a namespace as the "guest"; everything else is the same).
        """
        name = self.netns_name(sandbox_id)
        link = self.host_link_name(sandbox_id)
        async with self._lock:
            # Also refuse while another create of the same id is under way: its failure clean-up
            # would otherwise remove the network the first one is building.
            if netns.exists(name) or sandbox_id in self._used.values():
                raise NetworkError(f"sandbox {sandbox_id} already has a network")
            free = next((s for s in range(1, self._slots) if s not in self._used), None)
            if free is None:
                raise NetworkError(f"no free address in {self.config.host_range}")
            self._used[free] = sandbox_id
        host_ip, sandbox_ip = self._addresses(free)
        net = SandboxNetwork(sandbox_id, name, link, host_ip, sandbox_ip)
        try:
            await asyncio.to_thread(self._create_sync, net, guest_veth_netns)
        except BaseException as e:
            await self.destroy(sandbox_id)
            if isinstance(e, OSError | NetlinkError):
                raise NetworkError(f"network for sandbox {sandbox_id}: {e}") from None
            raise
        return net

    def _create_sync(self, net: SandboxNetwork, guest_veth_netns: str | None) -> None:
        host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)  # the worker's (main thread's)
        try:

            def inside() -> None:
                with IPRoute() as ipr:
                    lo = ipr.link_lookup(ifname="lo")[0]
                    ipr.link("set", index=lo, state="up")
                    ipr.link(
                        "add",
                        ifname=rules.HOST_LINK,
                        kind="veth",
                        peer={"ifname": net.host_link, "net_ns_fd": host_ns},
                    )
                    if guest_veth_netns is None:
                        _make_tap(rules.GUEST_LINK)
                    else:
                        guest_fd = os.open(netns.NETNS_DIR / guest_veth_netns, os.O_RDONLY)
                        try:
                            ipr.link(
                                "add",
                                ifname=rules.GUEST_LINK,
                                kind="veth",
                                peer={"ifname": "eth0", "net_ns_fd": guest_fd},
                            )
                        finally:
                            os.close(guest_fd)
                    g0 = ipr.link_lookup(ifname=rules.GUEST_LINK)[0]
                    h0 = ipr.link_lookup(ifname=rules.HOST_LINK)[0]
                    _sysctl("net/ipv4/ip_forward", "1")
                    _sysctl(f"net/ipv6/conf/{rules.HOST_LINK}/disable_ipv6", "1")
                    ipr.addr(
                        "add", index=g0, address=rules.GATEWAY_IP, prefixlen=rules.GUEST_PREFIX
                    )
                    # The guest gets an IPv6 route too: IPv6 attempts leave it, and are dropped.
                    ipr.addr("add", index=g0, address=rules.GATEWAY_IP6, prefixlen=64)
                    ipr.addr("add", index=h0, address=net.sandbox_ip, prefixlen=30)
                    ipr.link("set", index=g0, state="up")
                    ipr.link("set", index=h0, state="up")
                    if self.config.rate_mbit:
                        # What leaves by the tap goes to the guest, what leaves by the veth
                        # comes from it: a queue on each shapes both ways.
                        for index in (g0, h0):
                            _shape(ipr, index, self.config.rate_mbit)
                    ipr.route("add", dst="0.0.0.0/0", gateway=net.host_ip)
                rules.nft(rules.sandbox_ruleset(net.host_ip))

            netns.create(net.netns, inside)
        finally:
            os.close(host_ns)
        with IPRoute() as ipr:
            index = ipr.link_lookup(ifname=net.host_link)[0]
            _sysctl(f"net/ipv6/conf/{net.host_link}/disable_ipv6", "1")
            ipr.addr("add", index=index, address=net.host_ip, prefixlen=30)
            ipr.link("set", index=index, state="up")

    async def adopt(self, sandbox_id: str) -> SandboxNetwork | None:
        """The network a previous worker process made for `sandbox_id`, or None."""
        name = self.netns_name(sandbox_id)
        link = self.host_link_name(sandbox_id)
        if not netns.exists(name):
            return None
        host_ip = await asyncio.to_thread(_link_ipv4, link)
        if host_ip is None:
            return None
        slot = self._slot_of(host_ip)
        async with self._lock:
            self._used[slot] = sandbox_id
        return SandboxNetwork(sandbox_id, name, link, *self._addresses(slot))

    async def destroy(self, sandbox_id: str) -> bool:
        """Remove everything of `sandbox_id`'s network (idempotent; needs no prior state)."""
        name = self.netns_name(sandbox_id)
        link = self.host_link_name(sandbox_id)
        removed = await asyncio.to_thread(_remove, name, link)
        async with self._lock:
            for slot, owner in list(self._used.items()):
                if owner == sandbox_id:
                    del self._used[slot]
        return removed

    async def sweep(self, keep: Iterable[str] = ()) -> list[str]:
        """Remove every namespace and host link with our prefixes not belonging to `keep`."""
        keep_ns = {self.netns_name(k) for k in keep}
        keep_links = {self.host_link_name(k) for k in keep}
        removed = []
        for name in netns.names(self.config.netns_prefix):
            if name not in keep_ns:
                await self.destroy(name[len(self.config.netns_prefix) :])
                removed.append(name)
        for link in await asyncio.to_thread(_links, self.config.link_prefix):
            if link not in keep_links:
                await asyncio.to_thread(_remove, None, link)
                removed.append(link)
        return removed

    def open_tap(self, net: SandboxNetwork) -> int:
        """An fd on the sandbox's tap for QEMU (`-netdev tap,fd=N`); the caller closes it.

        The fd is bound to the device inside the namespace, so QEMU itself runs in the host's.
        """
        return netns.run_in(net.netns, lambda: open_tap_device(net.tap, persist=False))


def _check_id(sandbox_id: str) -> None:
    if not _ID.match(sandbox_id):
        raise NetworkError(f"invalid sandbox id {sandbox_id!r}: use letters, digits, _ . -")


def _sysctl(key: str, value: str) -> None:
    # /proc/sys/net is the namespace of the thread that opens it.
    Path("/proc/sys", key).write_text(value)


def open_tap_device(name: str, persist: bool = False) -> int:
    """An fd on tap `name` of the calling thread's network namespace (made if missing)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
        if persist:
            fcntl.ioctl(fd, TUNSETPERSIST, 1)
    except BaseException:
        os.close(fd)
        raise
    return fd


def tap_device_name(fd: int) -> str:
    """The name of the tap an fd from `open_tap_device` is bound to."""
    ifr = fcntl.ioctl(fd, TUNGETIFF, bytes(40))
    return ifr[:16].split(b"\0", 1)[0].decode()


def tap_namespace(fd: int) -> int:
    """A new fd on the network namespace the tap behind `fd` lives in; the caller closes it."""
    return fcntl.ioctl(fd, TUNGETDEVNETNS)


def _shape(ipr: IPRoute, index: int, mbit: int) -> None:
    """A token bucket on the link's egress. Its burst holds a whole offloaded segment (64 KiB
    and more: a smaller bucket would drop every one) and 10 ms at the rate."""
    burst = max(256 << 10, mbit * 125_000 // 100)
    ipr.tc("add", "tbf", index=index, handle="1:", rate=f"{mbit}mbit", burst=burst,
           latency="50ms")  # fmt: skip


def _make_tap(name: str) -> None:
    os.close(open_tap_device(name, persist=True))


def _link_ipv4(link: str) -> str | None:
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=link)
        if not found:
            return None
        for addr in ipr.get_addr(index=found[0], family=2):
            value = addr.get_attr("IFA_ADDRESS")
            if isinstance(value, str):
                return value
    return None


def _links(prefix: str) -> list[str]:
    with IPRoute() as ipr:
        names = (link.get_attr("IFLA_IFNAME") for link in ipr.get_links())
        return sorted(n for n in names if isinstance(n, str) and n.startswith(prefix))


def _remove(name: str | None, link: str) -> bool:
    removed = False
    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=link)
        if found:
            try:
                ipr.link("del", index=found[0])  # takes its peer h0 with it
                removed = True
            except NetlinkError as e:
                if e.code != errno.ENODEV:
                    raise
    if name is not None and netns.remove(name):
        removed = True  # the tap and the rules go with the namespace
    return removed

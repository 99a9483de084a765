"""A sandbox's network share: a token bucket on each side of its namespace holds it to its rate
both ways, whatever it sends; an unshaped network (the control) moves the same bytes at once."""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator

import pytest

from space.worker.network import NetworkConfig, NetworkManager, SandboxNetwork, rules
from space.worker.network import netns as nsutil
from tests.network.world import sh

RATE_MBIT = 40  # 5 MB/s
PAYLOAD = 8 << 20  # 1.6 s at the rate; a few milliseconds over an unshaped veth
# The bucket's burst (256 KiB) and a loose clock: still more than a second.
SHAPED_AT_LEAST_S = 1.2


def _config(rate_mbit: int) -> NetworkConfig:
    return NetworkConfig(host_range="10.209.0.0/16", link_prefix="spq-", netns_prefix="spq-sb-",
                         table="space_shares", proxy_port=27001, dns_port=27053,
                         rate_mbit=rate_mbit)  # fmt: skip


@pytest.fixture(params=[RATE_MBIT, 0], ids=["shaped", "unshaped"])
async def guest(request: pytest.FixtureRequest) -> AsyncIterator[tuple[int, str, SandboxNetwork]]:
    """A namespace standing in for the guest, behind a sandbox network at the given rate."""
    rate_mbit: int = request.param
    manager = NetworkManager(_config(rate_mbit))
    guest_ns = f"spq-guest-{secrets.token_hex(3)}"
    nsutil.create(guest_ns, lambda: None)
    try:
        net = await manager.create(f"shares{rate_mbit}", guest_veth_netns=guest_ns)
        n = ["ip", "-n", guest_ns]
        sh(*n, "link", "set", "lo", "up")
        sh(*n, "link", "set", "eth0", "address", rules.GUEST_MAC)
        sh(*n, "addr", "add", f"{rules.GUEST_IP}/{rules.GUEST_PREFIX}", "dev", "eth0")
        sh(*n, "link", "set", "eth0", "up")
        sh(*n, "route", "add", "default", "via", rules.GATEWAY_IP)
        yield rate_mbit, guest_ns, net
    finally:
        await manager.sweep()
        nsutil.remove(guest_ns)


def _transfer(guest_ns: str, host_ip: str, upload: bool) -> float:
    """Seconds to move PAYLOAD between the guest and a listener on the host's end of the veth."""
    server = socket.create_server((host_ip, 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def host_side() -> None:
        conn, _ = server.accept()
        with conn:
            if upload:
                got = 0
                while chunk := conn.recv(1 << 16):
                    got += len(chunk)
                assert got == PAYLOAD
            else:
                conn.sendall(b"x" * PAYLOAD)
        done.set()

    thread = threading.Thread(target=host_side)
    thread.start()

    def guest_side() -> float:
        with socket.create_connection((host_ip, port), timeout=60) as s:
            start = time.monotonic()
            if upload:
                s.sendall(b"x" * PAYLOAD)
                s.shutdown(socket.SHUT_WR)
                s.recv(1)  # the host closes once it has every byte
            else:
                got = 0
                while chunk := s.recv(1 << 16):
                    got += len(chunk)
                assert got == PAYLOAD
            return time.monotonic() - start

    try:
        return nsutil.run_in(guest_ns, guest_side)
    finally:
        thread.join(60)
        server.close()
        assert done.is_set()


@pytest.mark.parametrize("upload", [True, False], ids=["from_guest", "to_guest"])
async def test_the_rate_holds_both_ways(
    guest: tuple[int, str, SandboxNetwork], upload: bool
) -> None:
    rate, guest_ns, net = guest
    elapsed = await asyncio.to_thread(_transfer, guest_ns, net.host_ip, upload)
    if rate:
        assert elapsed >= SHAPED_AT_LEAST_S, f"{PAYLOAD} bytes in {elapsed:.2f} s at {rate} Mbit/s"
    else:
        assert elapsed < SHAPED_AT_LEAST_S, "the control: unshaped, the bytes move at once"

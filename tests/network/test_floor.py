"""The egress floor: what no sandbox policy opens, however it is written. A guest whose policy
asks for the cloud metadata service, every private network and another sandbox tries them all
through the real gateway; only the network the operator opened is reached."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from space.gateway import CidrRule, HostRule, Policy
from space.gateway.policy import EgressFloor
from tests.network.world import (
    METADATA_IP,
    NET_CONFIG,
    OPEN_NETWORK,
    ORIGINS,
    PRIVATE_ORIGIN,
    World,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux namespaces")

GREEDY = Policy(
    hosts=[
        HostRule(pattern="metadata.test", allow_private=True),
        HostRule(pattern="rebind.test", allow_private=True),
        HostRule(pattern="rebind-local.test", allow_private=True),
    ],
    cidrs=[CidrRule(cidr="0.0.0.0/0")],
    allow_networks=["169.254.0.0/16", "127.0.0.0/8", "10.0.0.0/8"],
)


@pytest.fixture(scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    w = World(tmp_path_factory.mktemp("floor"))
    try:
        await w.start()
        await w.add_guest("greedy", GREEDY)
        await w.add_guest("neighbour", Policy())
        yield w
    finally:
        await w.stop()


def curl(world: World, guest: str, url: str) -> str:
    proc = world.run_in_guest(
        world.guests[guest], ["curl", "-s", "-m", "5", "-o", "-", "-w", " %{http_code}", url]
    )
    return proc.stdout


def served_by(world: World, address: str) -> list[dict[str, object]]:
    return [e for e in world.internet_events() if e.get("served_by") == address]


async def test_the_metadata_address_is_never_dialled(world: World) -> None:
    # By IP (a CIDR rule covering it, and allow_networks naming it) and by a name that resolves
    # to it (a host rule with allow_private): the stand-in service sees nothing.
    assert "latest" not in curl(world, "greedy", f"http://{METADATA_IP}/latest/meta-data/")
    assert "hello" not in curl(world, "greedy", "http://metadata.test/")
    assert served_by(world, METADATA_IP) == []
    async with world.client() as gw:
        reasons = [e["reason"] for e in await gw.audit(sandbox="greedy")]
    # The name's answer lost its address; the raw connection found no rule the floor lets be.
    assert "allowed; blocked addresses stripped" in reasons, reasons
    assert "name not allowed on this port" in reasons, reasons


def test_only_the_network_the_operator_opened_is_reached(world: World) -> None:
    # The positive control: the same world's private origin, in the opened network, answers a
    # policy that asks for it, so the refusal above is the floor's and not a broken route.
    assert "hello from rebind.test" in curl(world, "greedy", "http://rebind.test/")
    assert served_by(world, PRIVATE_ORIGIN)
    # And the CIDR rule that covered the metadata address does reach a public one by IP.
    assert "hello" in curl(world, "greedy", f"http://{ORIGINS['other.test']}/")
    # A neighbour that does not ask for it gets nothing.
    before = len(served_by(world, PRIVATE_ORIGIN))
    assert "hello" not in curl(world, "neighbour", f"http://{PRIVATE_ORIGIN}/")
    assert len(served_by(world, PRIVATE_ORIGIN)) == before


@pytest.fixture
def host_listener(world: World) -> Iterator[tuple[str, list[bytes]]]:
    """A service of the host on the host's end of the neighbour's link (where a worker's own
    services would be reachable), recording every connection that reaches it."""
    address = world.guests["neighbour"].net.host_ip
    got: list[bytes] = []
    srv = socket.create_server((address, 8080))
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                conn, _ = srv.accept()
                got.append(conn.recv(100) or b"(connected)")
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield address, got
    finally:
        stop.set()
        thread.join(5)
        srv.close()


def test_the_host_behind_a_sandbox_link_is_never_dialled(
    world: World, host_listener: tuple[str, list[bytes]]
) -> None:
    address, got = host_listener
    # The positive control: from the host itself, the service answers at that address.
    with socket.create_connection((address, 8080), timeout=2) as s:
        s.sendall(b"ping")
    deadline = time.monotonic() + 2
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == [b"ping"]
    # The greedy guest's CIDR rule 0.0.0.0/0 covers it: the gateway never dials it.
    curl(world, "greedy", f"http://{address}:8080/")
    curl(world, "greedy", f"http://{world.guests['greedy'].net.host_ip}:8080/")
    time.sleep(0.5)
    assert got == [b"ping"]


def test_the_api_refuses_what_the_floor_never_opens() -> None:
    floor = EgressFloor(open_networks=[OPEN_NETWORK], closed_networks=[NET_CONFIG.host_range])
    refused = floor.refusals(
        Policy(
            cidrs=[CidrRule(cidr=c) for c in (f"{METADATA_IP}/32", "127.0.0.0/8", "10.0.0.0/8",
                                               NET_CONFIG.host_range, "0.0.0.0/0", OPEN_NETWORK)],
            allow_networks=["169.254.0.0/16", "192.168.0.0/16", "::1/128", OPEN_NETWORK],
        )
    )  # fmt: skip
    assert [r.split(":")[0] for r in refused] == [
        "cidrs[0]", "cidrs[1]", "cidrs[2]", "cidrs[3]", "allow_networks[0]", "allow_networks[1]",
        "allow_networks[2]",
    ]  # fmt: skip
    assert "cloud metadata" in refused[0] and OPEN_NETWORK in refused[2]
    closed = EgressFloor()
    assert closed.refusals(Policy(hosts=[HostRule(pattern="db.internal", allow_private=True)]))
    with pytest.raises(ValueError, match="link-local"):
        EgressFloor(open_networks=["169.254.0.0/16"])
    with pytest.raises(ValueError, match="loopback"):
        EgressFloor(open_networks=["0.0.0.0/0"])

"""Fair sharing of one worker's gateway: noisy sandboxes (thousands of connections, slowloris
heads, a DNS flood) must not keep a quiet one from its work; caps, deadlines and budgets hold;
deleting a sandbox or revoking a host closes its connections at once. The noisy and quiet
guests run tests/network/guestkit.py in their namespaces."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.gateway import CidrRule, HostRule, Policy
from tests.network import guestkit
from tests.network.world import (
    AUDIT_FILE_BYTES,
    AUDIT_FILES,
    AUDIT_RING,
    AUDIT_RINGS,
    DNS_BURST,
    DNS_IP,
    DNS_RATE,
    HEAD_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_TOTAL_CONNECTIONS,
    ORIGINS,
    Guest,
    World,
    wait_for,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux namespaces")

KIT = str(Path(guestkit.__file__))
ECHO = f"{ORIGINS['evil.test']}:22"  # reached by a CIDR rule


def quiet_policy() -> Policy:
    return Policy(
        hosts=[HostRule(pattern="other.test", ports=[80, 8080]),
               HostRule(pattern="allowed.test", tls="passthrough")],
        cidrs=[CidrRule(cidr=f"{ORIGINS['evil.test']}/32", ports=[22])],
    )  # fmt: skip


@pytest.fixture(scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    w = World(tmp_path_factory.mktemp("fairness"))
    try:
        await w.start()
        for name in ("quiet", "noisy1", "noisy2", "holder"):
            await w.add_guest(name, quiet_policy())
        yield w
    finally:
        await w.stop()


async def kit(world: World, guest: Guest, *args: str) -> dict[str, Any]:
    proc = await world.spawn_in_guest(guest, [sys.executable, KIT, *args])
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = json.loads(out)
    return result


async def test_noisy_guests_do_not_starve_a_quiet_one(world: World) -> None:
    """Technique: two guests each keep 1,500 connections open with slowloris heads (one also
    floods DNS). Mitigation: per-sandbox and gateway caps with a share for the busy gateway,
    a deadline on heads; the quiet guest's fetches all succeed, promptly."""
    g = world.guests
    other = ORIGINS["other.test"]
    floods = [asyncio.create_task(kit(world, g[n], "flood", other, "80", "1500", "12"))
              for n in ("noisy1", "noisy2")]  # fmt: skip
    dns = asyncio.create_task(kit(world, g["noisy1"], "dnsflood", g["noisy1"].net.gateway_ip,
                                  "other.test", "12", "0", "udp"))  # fmt: skip
    await asyncio.sleep(3)  # at full pressure
    quiet = asyncio.create_task(kit(world, g["quiet"], "fetch", "other.test", "40"))
    held: list[tuple[int, int, int]] = []
    async with world.client() as gw:
        while not quiet.done():
            n1, n2 = await gw.sandbox("noisy1"), await gw.sandbox("noisy2")
            assert n1 is not None and n2 is not None
            held.append(((await gw.health())["connections"], n1["connections"], n2["connections"]))
            await asyncio.sleep(0.2)
        fetched = await quiet
        results = await asyncio.gather(*floods, dns)
        n1 = await gw.sandbox("noisy1")
        assert n1 is not None
        events = await gw.audit(sandbox="noisy1", limit=100_000)
    assert not fetched["failed"], fetched["failures"]
    assert len(fetched["latencies"]) == 40
    assert max(fetched["latencies"]) < 2.0, fetched["latencies"]
    assert statistics.median(fetched["latencies"]) < 0.5, fetched["latencies"]
    assert all(total <= MAX_TOTAL_CONNECTIONS for total, _, _ in held), held
    assert all(a <= MAX_CONNECTIONS and b <= MAX_CONNECTIONS for _, a, b in held), held
    # The two together stay clear of the gateway's cap: the last quarter is for others.
    assert max(a + b for _, a, b in held) < MAX_TOTAL_CONNECTIONS, held
    for flood in results[:2]:
        assert flood["refused"] > 1000, flood  # most were turned away at once
        assert flood["held_longest_s"] < HEAD_TIMEOUT + 1.5, flood  # no head outlived its deadline
    # Thousands refused, a handful of audit events: one per run of refusals.
    runs = [e for e in events if "refused until it holds fewer" in e["reason"]]
    assert 0 < len(runs) < n1["refused"]["connections"] / 20, (len(runs), n1["refused"])


async def test_a_dns_flood_is_limited_and_a_quiet_guest_still_resolves(world: World) -> None:
    """Technique: query the gateway's resolver as fast as it answers, over UDP and TCP.
    Mitigation: a token bucket per sandbox (REFUSED beyond it, audited once per run); the
    quiet guest's lookups are all answered meanwhile."""
    g = world.guests
    udp_server = g["noisy2"].net.gateway_ip
    seconds = "4"

    def flood(proto: str, server: str) -> asyncio.Task[dict[str, Any]]:
        args = ("dnsflood", server, "other.test", seconds, "0", proto)
        return asyncio.create_task(kit(world, g["noisy2"], *args))

    # TCP to port 53 of any address goes to the gateway's resolver (the namespace's own
    # address takes no TCP).
    floods = [flood("udp", udp_server), flood("tcp", DNS_IP)]
    quiet = await kit(world, g["quiet"], "dnsflood", udp_server, "other.test", seconds, "10", "udp")
    udp, tcp = await asyncio.gather(*floods)
    assert quiet["answered"] >= 30 and quiet["refused"] == quiet["lost"] == 0, quiet
    answered = udp["answered"] + tcp["answered"]
    assert answered <= DNS_BURST + DNS_RATE * (float(seconds) + 1), (udp, tcp)  # the bucket's worth
    assert udp["refused"] > answered and tcp["refused"] > 0, (udp, tcp)
    async with world.client() as gw:
        events = await gw.audit(sandbox="noisy2", limit=100_000)
        info = await gw.sandbox("noisy2")
    runs = [e for e in events if "REFUSED until it slows down" in e["reason"]]
    assert info is not None and info["refused"]["dns"] >= udp["refused"] + tcp["refused"]
    assert 1 <= len(runs) <= 2, runs  # not one per refused query


async def test_a_flood_of_audit_events_keeps_other_sandboxes_trails(world: World) -> None:
    """Technique: make the gateway log thousands of decisions (requests for a name the policy
    does not list) to push the other sandboxes' trails out. Mitigation: a bounded ring per
    sandbox, a bounded number of rings, and the file rotated by size (N kept)."""
    g = world.guests
    assert not (await kit(world, g["quiet"], "fetch", "other.test", "3"))["failed"]
    async with world.client() as gw:
        before = await gw.audit(sandbox="quiet", limit=100_000)
        denied = await kit(world, g["noisy1"], "fetch", "evil.test", str(3 * AUDIT_RING), "0",
                           ORIGINS["evil.test"])  # fmt: skip
        assert denied["failed"] == 3 * AUDIT_RING, denied
        after = await gw.audit(sandbox="quiet", limit=100_000)
        assert [e["seq"] for e in after][: len(before)] == [e["seq"] for e in before]
        transport = httpx.AsyncHTTPTransport(uds=str(world.control_socket))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            noisy = (await c.get("/audit", params={"sandbox": "noisy1", "limit": 100_000})).json()
        assert len(noisy["events"]) == AUDIT_RING and noisy["dropped"] >= AUDIT_RING, len(noisy)
        # The file rotated: at most AUDIT_FILES old ones, none much over the size.
        directory = world.directory / "gateway" / "audit"
        files = sorted(directory.glob("audit.jsonl*"))
        assert len(files) == AUDIT_FILES + 1, files
        assert all(f.stat().st_size <= AUDIT_FILE_BYTES + 1024 for f in files), files
        # More sandboxes than the rings kept: the longest quiet trails go, the count stays.
        for i in range(2 * AUDIT_RINGS):
            await gw.set_policy(f"gone{i}", f"10.201.255.{i + 1}", Policy())
        for i in range(2 * AUDIT_RINGS):
            await gw.remove(f"gone{i}")
        stats = (await gw.health())["audit"]
        assert stats["rings"] <= AUDIT_RINGS and stats["rings_dropped"] >= AUDIT_RINGS, stats


def test_gateway_raised_its_descriptor_limit(world: World) -> None:
    assert world.gateway is not None and world.gateway.pid is not None
    limits = Path(f"/proc/{world.gateway.pid}/limits").read_text().splitlines()
    soft = int(next(line for line in limits if line.startswith("Max open files")).split()[3])
    assert soft >= 2 * MAX_TOTAL_CONNECTIONS + 1024, soft


async def test_connections_close_when_a_host_is_revoked_or_the_sandbox_removed(
    world: World,
) -> None:
    """Technique: keep connections open across a policy change that revokes their host, and
    across the sandbox's deletion. Mitigation: both close them at once, at both ends."""
    holder = world.guests["holder"]
    specs = ["http:other.test:8080", f"tls:allowed.test:{world.origin_ca}", f"tcp:{ECHO}"]
    proc = await world.spawn_in_guest(holder, [sys.executable, KIT, "hold", *specs])
    assert proc.stdin is not None and proc.stdout is not None

    async def probe() -> dict[str, str]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(b"probe\n")
        await proc.stdin.drain()
        state: dict[str, str] = json.loads(await proc.stdout.readline())
        return state

    try:
        ready = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert json.loads(ready or b"{}") == {"ready": True}, await proc.stderr.read()  # type: ignore[union-attr]
        assert set((await probe()).values()) == {"open"}
        echoes = [e for e in world.internet_events() if e["kind"] == "tcp-echo"]
        async with world.client() as gw:
            without_other = quiet_policy()
            without_other.hosts = [r for r in without_other.hosts if r.pattern != "other.test"]
            start = time.monotonic()
            await gw.set_policy("holder", holder.net.sandbox_ip, without_other)
            state = await probe()
            assert time.monotonic() - start < 2.0
            assert state == {specs[0]: "closed", specs[1]: "open", specs[2]: "open"}, state
            await gw.remove("holder")
            state = await probe()
            assert set(state.values()) == {"closed"}, state
            assert time.monotonic() - start < 4.0
            # The origin's end went too (not left to an idle timeout).
            peer = echoes[-1]["peer"]

            def origin_closed() -> bool:
                events = world.internet_events()
                return any(e["kind"] == "tcp-echo-closed" and e["peer"] == peer for e in events)

            await wait_for(origin_closed, 2.0)
            assert origin_closed(), peer
            await gw.set_policy("holder", holder.net.sandbox_ip, quiet_policy())
    finally:
        proc.stdin.close()
        await proc.wait()

"""The gateway and sandbox networks with real parts: namespaces, nftables, a gateway process, DNS
and HTTP(S) origins in an "internet" namespace. The red-team suite (redteam/attacks.py) runs in a
guest namespace; each of its attacks is one test here."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import secrets
import shutil
import stat
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.gateway import GatewayClient, HostRule, Policy, Secret
from space.worker.network import NetworkError, NetworkManager
from space.worker.network import netns as nsutil
from tests.network.redteam import attacks
from tests.network.world import (
    BEARER,
    GATEWAY_USER,
    HEADER_SECRET,
    MAX_CONNECTIONS,
    NET_CONFIG,
    ZONE,
    World,
    guest_config,
    sh,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux namespaces")

PLACEHOLDER = "space-secret-" + secrets.token_hex(16)
ATTACKS = Path(attacks.__file__)


def policy_a() -> Policy:
    return Policy(
        hosts=[
            HostRule(pattern="allowed.test", tls="passthrough", ports=[80, 443, 8080]),
            HostRule(pattern="inspect.test", tls="inspect"),
            HostRule(pattern="secret.test", ports=[80, 443, 8443]),
            HostRule(pattern="rebind.test"),
            HostRule(pattern="rebind-local.test"),
            HostRule(pattern="metadata.test"),
        ],
        secrets=[
            Secret(name="bearer", value=BEARER, hosts=["secret.test"], placeholder=PLACEHOLDER),
            Secret(name="header", value=HEADER_SECRET, hosts=["secret.test"], header="X-Api-Key"),
        ],
    )


def policy_b() -> Policy:
    return Policy(hosts=[HostRule(pattern="other.test")])


@pytest.fixture(scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    w = World(tmp_path_factory.mktemp("network"))
    try:
        await w.start()
        await w.add_guest("a", policy_a())
        await w.add_guest("b", policy_b())
        yield w
    finally:
        await w.stop()
    # Nothing of the world may outlive it: namespaces, links, the host table.
    assert not nsutil.names("spt-")
    assert "space_test" not in sh("nft", "list", "tables").stdout
    assert "spt-" not in sh("ip", "-o", "link", "show").stdout


@pytest.fixture(scope="module")
def redteam(world: World) -> dict[str, dict[str, Any]]:
    a, b = world.guests["a"], world.guests["b"]
    config = guest_config(world, a, [b], PLACEHOLDER)
    path = world.directory / "redteam.json"
    path.write_text(json.dumps(config))
    out = world.directory / "redteam-results.json"
    proc = world.run_in_guest(
        a,
        [sys.executable, str(ATTACKS), "--json", str(out)],
        env={"SPACE_REDTEAM_CONFIG": str(path), "SPACE_SECRET_BEARER": PLACEHOLDER},
    )
    if not out.exists():
        pytest.fail(f"red-team suite did not run: {proc.stdout}\n{proc.stderr}")
    return {r["name"]: r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("name", [a.name for a in attacks.ATTACKS])
def test_redteam(redteam: dict[str, dict[str, Any]], name: str) -> None:
    result = redteam[name]
    expected = "works" if result["positive"] else "held"
    assert result["outcome"] == expected, f"{result['technique']}: {result['detail']}"


def test_origin_saw_real_secrets_never_the_placeholder(
    world: World, redteam: dict[str, dict[str, Any]]
) -> None:
    """The guest only ever had the placeholder; the bound origin got the real values."""
    events = world.internet_events()
    auth = [e for e in events if e.get("path") == "/auth" and e["kind"] == "https"]
    assert any(e["headers"].get("authorization") == f"Bearer {BEARER}" for e in auth)  # type: ignore[union-attr]
    header = [e for e in events if e.get("path") == "/header"]
    assert header and header[0]["headers"]["x-api-key"] == HEADER_SECRET  # type: ignore[index]
    assert PLACEHOLDER not in world.internet_log.read_text()


def test_no_smuggled_request_reached_a_lenient_origin(
    world: World, redteam: dict[str, dict[str, Any]]
) -> None:
    """What the lenient origins (which split heads at any CR or LF) read while the red-team
    suite tried to smuggle requests past the gateway: only requests it checked, each once, and
    the credentials only where the gateway put them."""
    events = [e for e in world.internet_events() if e["kind"] == "lenient"]
    paths = [str(e["path"]) for e in events]
    assert paths.count("/one") == 4 and paths.count("/two") == 1, paths  # the positive checks
    for event in events:
        text = json.dumps(event)
        assert "smuggled" not in text and PLACEHOLDER not in text, event
        headers = dict(event["headers"])  # type: ignore[call-overload]
        others = {k: v for k, v in headers.items() if k not in ("authorization", "x-api-key")}
        elsewhere = json.dumps({**event, "headers": others})
        assert BEARER not in elsewhere and HEADER_SECRET not in elsewhere, event
        assert headers["x-api-key"] == HEADER_SECRET  # injected on every request to its host


def test_secret_echoed_by_the_origin_is_masked(world: World) -> None:
    """Technique: ask the bound host to echo the request's credentials back.
    Mitigation: the gateway overwrites injected values in the response."""
    fetch = (
        "import socket, ssl, sys\n"
        "ctx = ssl.create_default_context(cafile=sys.argv[1])\n"
        "s = ctx.wrap_socket(socket.create_connection(('secret.test', 443)),"
        " server_hostname='secret.test')\n"
        "s.sendall(f'GET /echo HTTP/1.1\\r\\nHost: secret.test\\r\\n"
        "Authorization: Bearer {sys.argv[2]}\\r\\n\\r\\n'.encode())\n"
        "out = b''\n"
        "while d := s.recv(65536): out += d\n"
        "print(out.decode())\n"
    )
    proc = world.run_in_guest(
        world.guests["a"],
        [sys.executable, "-c", fetch, str(world.gateway_ca), PLACEHOLDER],
        timeout=30,
    )
    assert "200 OK" in proc.stdout, proc.stderr
    assert BEARER not in proc.stdout and HEADER_SECRET not in proc.stdout
    assert "Bearer " + "*" * len(BEARER) in proc.stdout
    echoed = [e for e in world.internet_events() if e.get("path") == "/echo"]
    assert echoed and echoed[-1]["headers"]["accept-encoding"] == "identity"  # type: ignore[index]


def test_a_sandbox_cannot_exhaust_the_gateway(world: World) -> None:
    """Technique: hold many idle connections open. Mitigation: a per-sandbox limit; past it new
    connections are refused, and the sandbox recovers once it lets go."""
    script = (
        "import socket, sys, time\n"
        "def get():\n"
        "    try:\n"
        "        s = socket.create_connection((sys.argv[2], 80), timeout=3)\n"
        "        s.sendall(b'GET / HTTP/1.1\\r\\nHost: other.test\\r\\n\\r\\n')\n"
        "        return s.recv(100).startswith(b'HTTP/1.1 200')\n"
        "    except OSError:  # refused: closed or reset\n"
        "        return False\n"
        "idle = [socket.create_connection((sys.argv[2], 80)) for _ in range(int(sys.argv[1]))]\n"
        "time.sleep(0.5)\n"
        "print('over limit', get())\n"
        "for s in idle: s.close()\n"
        "time.sleep(0.5)\n"
        "print('after', get())\n"
    )
    proc = world.run_in_guest(
        world.guests["b"],
        [sys.executable, "-c", script, str(MAX_CONNECTIONS), ZONE["other.test"]],
        timeout=60,
    )
    assert "over limit False" in proc.stdout and "after True" in proc.stdout, proc.stderr


def test_upstream_dns_saw_only_allowed_names(
    world: World, redteam: dict[str, dict[str, Any]]
) -> None:
    """No exfiltrated label, and no name outside a policy, ever reached the outside resolver."""
    asked = {str(e["name"]) for e in world.internet_events() if e["kind"] == "dns"}
    allowed = {r.pattern for r in policy_a().hosts} | {r.pattern for r in policy_b().hosts}
    assert asked and asked <= allowed, asked - allowed


async def test_audit_log_records_why(world: World, redteam: dict[str, dict[str, Any]]) -> None:
    async with world.client() as gw:
        events = await gw.audit(sandbox="a", limit=100_000)
    reasons = {(e["decision"], e["reason"]) for e in events}
    for expected in (
        ("deny", "name not allowed"),
        ("deny", "CONNECT is not served"),
        ("deny", "name resolves only to blocked addresses"),
        ("deny", "placeholder of secret 'bearer' sent to a host it is not bound to"),
        ("allow", "TLS passed through by SNI"),
        ("allow", "GET request; injected bearer, header"),
    ):
        assert expected in reasons, expected
    assert all(e["sandbox"] == "a" for e in events)
    files = (world.directory / "gateway" / "audit").glob("audit.jsonl*")  # rotated by size
    lines = [line for f in files for line in f.read_text().splitlines()]
    assert len(lines) >= len(events)


async def test_policy_changes_take_effect_at_once(world: World) -> None:
    b = world.guests["b"]
    fetch = [sys.executable, "-c", "import urllib.request as u; print(u.urlopen("
             "'http://other.test/', timeout=3).read().decode())"]  # fmt: skip
    assert "hello from other.test" in world.run_in_guest(b, fetch, timeout=30).stdout
    async with world.client() as gw:
        await gw.set_policy("b", b.net.sandbox_ip, Policy())
        try:
            proc = world.run_in_guest(b, fetch, timeout=30)
            assert proc.returncode != 0 and "hello" not in proc.stdout
        finally:
            await gw.set_policy("b", b.net.sandbox_ip, policy_b())


def test_gateway_runs_unprivileged_and_its_socket_is_root_only(world: World) -> None:
    assert world.gateway is not None and world.gateway.pid is not None
    status = Path(f"/proc/{world.gateway.pid}/status").read_text()
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {str(pwd.getpwnam(GATEWAY_USER).pw_uid)}, uids
    mode = world.control_socket.stat()
    assert mode.st_uid == 0 and stat.S_IMODE(mode.st_mode) == 0o600


async def test_control_api_rejects_a_bad_policy(world: World) -> None:
    transport = httpx.AsyncHTTPTransport(uds=str(world.control_socket))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.put("/sandboxes/x", json={"address": "not-an-ip", "policy": {}})
        assert r.status_code == 422 and "address" in r.json()["detail"]
        r = await c.get("/sandboxes/a")
        assert r.status_code == 200
        assert all("value" not in secret for secret in r.json()["policy"]["secrets"])
        assert BEARER not in r.text


async def test_unregistered_sandbox_gets_nothing(world: World) -> None:
    """A network whose policy was never pushed (or was removed) is denied everything."""
    async with world.client() as gw:
        assert await gw.remove("b")
        try:
            b = world.guests["b"]
            probe = [sys.executable, str(ATTACKS), "--json", str(world.directory / "b.json")]
            config = guest_config(world, b, [], PLACEHOLDER)
            (world.directory / "b-config.json").write_text(json.dumps(config))
            proc = world.run_in_guest(
                b, [*probe, "allowed_http_works"],
                env={"SPACE_REDTEAM_CONFIG": str(world.directory / "b-config.json")},
            )  # fmt: skip
            assert proc.returncode != 0  # the positive check cannot work without a policy
        finally:
            await gw.set_policy("b", world.guests["b"].net.sandbox_ip, policy_b())


async def test_create_destroy_sweep_leave_nothing(world: World) -> None:
    manager = NetworkManager(NET_CONFIG)
    times = []
    for i in range(10):
        start = time.perf_counter()
        await manager.create(f"t{i}")
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.5, times
    net = await manager.adopt("t0")
    assert net is not None and net.sandbox_ip.startswith("10.201.")
    fd = manager.open_tap(net)  # what QEMU gets: the tap inside the namespace
    os.close(fd)
    assert await manager.destroy("t0")
    assert not await manager.destroy("t0")  # idempotent
    # Two creates of one id at once: one wins, the other fails without harming it.
    outcomes = await asyncio.gather(
        manager.create("t0"), manager.create("t0"), return_exceptions=True
    )
    assert sum(isinstance(o, NetworkError) for o in outcomes) == 1, outcomes
    assert nsutil.exists("spt-sb-t0") and await manager.adopt("t0") is not None
    # A "crashed" worker left t0..t9: a new manager's sweep (keeping the world's) removes them.
    removed = await NetworkManager(NET_CONFIG).sweep(keep=list(world.guests))
    assert sorted(removed) == sorted(f"spt-sb-t{i}" for i in range(10))
    assert not [n for n in nsutil.names("spt-sb-t")]
    links = sh("ip", "-o", "link", "show").stdout
    for guest in world.guests.values():
        assert guest.net.host_link in links  # the live sandboxes were kept
    hosts = [manager.host_link_name(f"t{i}") for i in range(10)]
    assert not any(h in links for h in hosts)


def test_gateway_client_reports_unreachable(tmp_path: Path) -> None:
    async def probe() -> None:
        async with GatewayClient(tmp_path / "none.sock") as gw:
            with pytest.raises(Exception, match="gateway unreachable"):
                await gw.health()

    asyncio.run(probe())


def _tap_carrier(namespace: str) -> int:
    from pyroute2 import IPRoute  # type: ignore[import-untyped]

    def read() -> int:
        with IPRoute() as ipr:
            link = ipr.get_links(ifname="g0")[0]
            return int(link.get_attr("IFLA_CARRIER"))

    return nsutil.run_in(namespace, read)


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs QEMU")
async def test_qemu_in_the_host_namespace_drives_the_tap_by_fd() -> None:
    """How the worker starts QEMU: the tap is opened inside the sandbox's namespace and its fd
    handed over (`-netdev tap,fd=N`); QEMU itself stays in the host namespace."""
    manager = NetworkManager(NET_CONFIG)
    net = await manager.create("qemu-tap")
    proc: asyncio.subprocess.Process | None = None
    try:
        assert _tap_carrier(net.netns) == 0  # nobody on the guest end yet
        fd = manager.open_tap(net)
        try:
            proc = await asyncio.create_subprocess_exec(
                "qemu-system-x86_64", "-M", "microvm", "-accel", "tcg", "-nodefaults",
                "-no-user-config", "-display", "none", "-S",
                "-netdev", f"tap,id=net0,fd={fd}",
                "-device", f"virtio-net-device,netdev=net0,mac={net.guest_mac}",
                pass_fds=[fd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(fd)  # QEMU holds its own copy
        deadline = time.monotonic() + 10
        while _tap_carrier(net.netns) != 1:
            assert proc.returncode is None, "QEMU exited"
            assert time.monotonic() < deadline, "QEMU never attached to the tap"
            await asyncio.sleep(0.05)
    finally:
        if proc is not None:
            proc.kill()
            await proc.wait()
        await manager.destroy("qemu-tap")
    assert not nsutil.exists(net.netns)


async def test_gateway_and_worker_restarts_keep_sandboxes_working(world: World) -> None:
    """The gateway keeps policies in memory: after it restarts, the worker's Egress.start
    re-pushes them and re-adopts the live networks (no VM needs a new tap)."""
    b = world.guests["b"]
    fetch = [sys.executable, "-c", "import urllib.request as u; print(u.urlopen("
             "'http://other.test/', timeout=3).read().decode())"]  # fmt: skip
    assert world.gateway is not None
    await world.gateway.stop()
    assert "hello" not in world.run_in_guest(b, fetch, timeout=30).stdout  # no gateway: nothing
    egress = await world.start_gateway()  # a new worker process: a fresh Egress, same manager
    rebuilt = await egress.start({"a": policy_a(), "b": policy_b()})
    assert rebuilt == []
    assert egress.network("b") == b.net
    assert "hello from other.test" in world.run_in_guest(b, fetch, timeout=30).stdout


TRAFFIC = """
import http.client, ssl, sys
ca_gateway, ca_origin = sys.argv[1], sys.argv[2]
def go(conn, method, path, body=None):
    conn.request(method, path, body=body, headers={"Content-Type": "application/octet-stream"})
    got = conn.getresponse().read()
    conn.close()
    return len(got)
plain = lambda: http.client.HTTPConnection("allowed.test", 80, timeout=20)
print(go(plain(), "POST", "/", b"u" * 300_000))
print(go(plain(), "GET", "/bytes/500000"))
# Spliced by name (the origin's own certificate) and terminated (the deployment's).
passed = ssl.create_default_context(cafile=ca_origin)
print(go(http.client.HTTPSConnection("allowed.test", 443, context=passed, timeout=20),
         "GET", "/bytes/200000"))
inspected = ssl.create_default_context(cafile=ca_gateway)
print(go(http.client.HTTPSConnection("inspect.test", 443, context=inspected, timeout=20),
         "POST", "/", b"i" * 100_000))
"""


async def test_the_gateway_counts_each_sandboxs_bytes_by_host(world: World) -> None:
    """What a guest sends and receives through its gateway is counted by the host it went to,
    within the framing (heads, TLS records) of what the origin itself took and gave."""
    policy = Policy(hosts=[HostRule(pattern="allowed.test", tls="passthrough", ports=[80, 443]),
                           HostRule(pattern="inspect.test", tls="inspect")])  # fmt: skip
    guest = await world.add_guest("counted", policy)
    assert world.origin_ca is not None
    proc = world.run_in_guest(
        guest, [sys.executable, "-c", TRAFFIC, str(world.gateway_ca), str(world.origin_ca)],
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:3] == ["500000", "200000"], proc.stdout
    async with world.client() as gw:
        traffic = (await gw.traffic())["counted"]
    assert traffic.epoch  # the run of counts these are (a sandbox taken on anew starts another)
    counted = traffic.hosts
    assert set(counted) == {"allowed.test", "inspect.test"}
    sent, received = counted["allowed.test"]
    assert 300_000 < sent < 300_000 + 8_000, counted  # the body, heads and a TLS handshake
    assert 700_000 < received < 700_000 + 12_000, counted
    sent, received = counted["inspect.test"]  # as the gateway wrote it, before its own TLS
    assert 100_000 < sent < 100_000 + 1_000 and 0 < received < 1_000, counted

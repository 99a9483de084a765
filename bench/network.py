"""Network benchmark: what the per-sandbox network and the gateway cost, against a direct path.

  - HTTPS request latency (new connection, TLS handshake, GET, response) from a guest namespace:
    through the gateway with TLS passed through by SNI, through the gateway with TLS terminated
    (deployment CA, re-encrypted upstream)  vs  from a namespace wired straight to the origins
  - HTTPS download throughput on the same three paths
  - set-up and tear-down time of one sandbox network (namespace, tap, veth pair, nftables)

Builds its own world of namespaces (tests/network/world.py: origins, DNS, a real gateway
process) and removes it afterwards. Run as root:
  .venv/bin/python bench/network.py [--requests 200] [--mb 100] [--networks 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.network.world

from tests.network.world import INET_NS, ORIGINS, World, sh

from space.gateway import HostRule, Policy
from space.worker.network import NetworkConfig, NetworkManager
from space.worker.network import netns as nsutil
from vm_runtime import percentile_table, percentiles

DIRECT_NS = "spt-direct"


def fetch(address: str, name: str, path: str, cafile: str) -> int:
    """One HTTPS request on a new connection; the number of body bytes read."""
    ctx = ssl.create_default_context(cafile=cafile)
    with (
        socket.create_connection((address, 443), timeout=30) as raw,
        ctx.wrap_socket(raw, server_hostname=name) as s,
    ):
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
        total = 0
        while data := s.recv(262144):
            total += len(data)
        return total


def client(args: argparse.Namespace) -> None:
    """Runs inside a namespace: latency and throughput of one path, as JSON on stdout."""
    fetch(args.address, args.name, "/", args.ca)  # warm: leaf certificate, DNS cache
    samples = []
    for _ in range(args.requests):
        t = time.perf_counter()
        fetch(args.address, args.name, "/", args.ca)
        samples.append(time.perf_counter() - t)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        got = fetch(args.address, args.name, f"/bytes/{args.mb * 1_000_000}", args.ca)
        rates.append(got / (time.perf_counter() - t) / 1e6)
    print(json.dumps({"latency": percentiles(samples), "mb_s": max(rates)}))


def run_client(ns: str, address: str, name: str, ca: Path, requests: int, mb: int) -> Any:
    argv = ["ip", "netns", "exec", ns, sys.executable, __file__, "--client", "--address",
            address, "--name", name, "--ca", str(ca), "--requests", str(requests),
            "--mb", str(mb)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"client in {ns} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def direct_namespace() -> None:
    """A namespace with a veth straight into the internet namespace: the no-gateway baseline."""
    nsutil.create(DIRECT_NS, lambda: None)
    sh("ip", "-n", DIRECT_NS, "link", "add", "eth0", "type", "veth", "peer", "name", "direct0",
       "netns", INET_NS)  # fmt: skip
    sh("ip", "-n", DIRECT_NS, "addr", "add", "198.18.0.2/30", "dev", "eth0")
    sh("ip", "-n", DIRECT_NS, "link", "set", "eth0", "up")
    sh("ip", "-n", DIRECT_NS, "route", "add", "default", "via", "198.18.0.1")
    sh("ip", "-n", INET_NS, "addr", "add", "198.18.0.1/30", "dev", "direct0")
    sh("ip", "-n", INET_NS, "link", "set", "direct0", "up")


async def setup_times(n: int) -> dict[str, Any]:
    manager = NetworkManager(
        NetworkConfig(
            host_range="10.202.0.0/16",
            link_prefix="spb-",
            netns_prefix="spb-sb-",
            table="space_bench",
            proxy_port=26001,
            dns_port=26053,
        )
    )
    await manager.start()
    creates, destroys = [], []
    try:
        for i in range(n):
            t = time.perf_counter()
            await manager.create(f"bench{i}")
            creates.append(time.perf_counter() - t)
        for i in range(n):
            t = time.perf_counter()
            await manager.destroy(f"bench{i}")
            destroys.append(time.perf_counter() - t)
    finally:
        await manager.sweep()
        await manager.stop()
    return {"network_create": percentiles(creates), "network_destroy": percentiles(destroys)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="space-bench-net-") as tmp:
        world = World(Path(tmp))
        try:
            await world.start()
            guest = await world.add_guest(
                "bench",
                Policy(hosts=[HostRule(pattern="allowed.test", tls="passthrough"),
                              HostRule(pattern="inspect.test", tls="inspect")]),
            )  # fmt: skip
            direct_namespace()
            assert world.origin_ca is not None
            paths = {
                "direct": (DIRECT_NS, ORIGINS["allowed.test"], "allowed.test", world.origin_ca),
                "gateway_passthrough": (guest.netns, ORIGINS["allowed.test"], "allowed.test",
                                        world.origin_ca),
                "gateway_tls_terminated": (guest.netns, ORIGINS["inspect.test"], "inspect.test",
                                           world.gateway_ca),
            }  # fmt: skip
            for label, (ns, address, name, ca) in paths.items():
                out = run_client(ns, address, name, ca, args.requests, args.mb)
                results[f"https_request_{label}"] = out["latency"]
                results[f"https_mb_s_{label}"] = round(out["mb_s"], 1)
        finally:
            nsutil.remove(DIRECT_NS)
            await world.stop()
    results.update(await setup_times(args.networks))
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--address")
    p.add_argument("--name")
    p.add_argument("--ca")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--networks", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.client:
        client(args)
        return
    results = asyncio.run(bench(args))
    print("\n".join(percentile_table(results)))
    for key, value in results.items():
        if key.startswith("https_mb_s_"):
            print(f"HTTPS download, {key.removeprefix('https_mb_s_')}: {value} MB/s")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

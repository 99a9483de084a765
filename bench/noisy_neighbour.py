"""Noisy-neighbour benchmark: what a sandbox flooding its worker's gateway costs another one.

A quiet guest looks other.test up (the gateway's resolver) and GETs it on a new connection
(through the gateway), `--rate` times a second, `--requests` times:
  - alone: the baseline, in the same run
  - while a noisy guest keeps `--connections` connections open with slowloris heads (each one
    the gateway refuses or cuts off is opened again at once)
  - while the noisy guest floods the resolver (UDP, each query as soon as the last was answered)
  - while it does both
  - alone again
The gateway runs with its production limits (GatewaySettings' defaults: 512 connections per
sandbox, 8,192 in all, heads 10 s, DNS 100/s). Builds its own world of namespaces
(tests/network/world.py) and removes it afterwards. Run as root:
  .venv/bin/python bench/noisy_neighbour.py [--requests 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.network

from tests.network import guestkit
from tests.network.world import ORIGINS, Guest, World

from space.gateway import HostRule, Policy
from vm_runtime import percentile_table, percentiles

KIT = str(Path(guestkit.__file__))
# Alone once more at the end: how far the baseline itself moves in one run.
PHASES = {"alone": (), "connection_flood": ("connections",), "dns_flood": ("dns",),
          "both_floods": ("connections", "dns"), "alone_again": ()}  # fmt: skip


async def start(world: World, guest: Guest, *args: str) -> asyncio.subprocess.Process:
    """A guestkit command that runs until its stdin is closed."""
    return await world.spawn_in_guest(guest, [sys.executable, KIT, *args])


async def report(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    out, err = await proc.communicate(b"")  # closes stdin: the command stops and reports
    if proc.returncode != 0:
        raise RuntimeError(f"guestkit failed: {err.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out)
    return result


async def phase(
    world: World, quiet: Guest, noisy: Guest, floods: tuple[str, ...], args: argparse.Namespace
) -> dict[str, Any]:
    noise = []
    if "connections" in floods:
        noise.append(await start(world, noisy, "flood", ORIGINS["other.test"], "80",
                                 str(args.connections), "0"))  # fmt: skip
    if "dns" in floods:
        noise.append(await start(world, noisy, "dnsflood", noisy.net.gateway_ip, "other.test",
                                 "0", "0", "udp"))  # fmt: skip
    if noise:
        await asyncio.sleep(3)  # at full pressure before the quiet guest starts
    fetch = await start(world, quiet, "fetch", "other.test", str(args.requests), str(1 / args.rate))
    fetched = await report(fetch)
    noisy_out = [await report(proc) for proc in noise]
    return {"quiet": percentiles(fetched["latencies"]), "quiet_failed": fetched["failed"],
            "noisy": noisy_out}  # fmt: skip


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"settings": {"requests": args.requests, "rate": args.rate,
                                            "connections": args.connections}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="space-bench-noisy-") as tmp:
        world = World(Path(tmp), limits={})  # the gateway's own defaults
        try:
            await world.start()
            policy = Policy(hosts=[HostRule(pattern="other.test")])
            quiet = await world.add_guest("quiet", policy)
            noisy = await world.add_guest("noisy", policy)
            for label, floods in PHASES.items():
                results[label] = await phase(world, quiet, noisy, floods, args)
        finally:
            await world.stop()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=300, help="the quiet guest's, per phase")
    p.add_argument("--rate", type=float, default=20.0, help="the quiet guest's requests a second")
    p.add_argument("--connections", type=int, default=2000, help="the noisy guest keeps open")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = asyncio.run(bench(args))
    latency = {f"quiet fetch, {label.replace('_', ' ')}": results[label]["quiet"]
               for label in PHASES}  # fmt: skip
    print("\n".join(percentile_table(latency)))
    for label in PHASES:
        r = results[label]
        print(f"{label}: quiet failures {r['quiet_failed']}; noisy {r['noisy']}")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

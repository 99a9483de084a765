"""Many clients at once: each runs commands and file writes against a sandbox of its own, all on
one worker, against one client alone on the same platform (in the same run).

  1. `--clients` sandboxes are made and kept for the whole run (the lone client's phase runs
     beside the others' idle guests too, so both phases pay for them);
  2. at rest: the host's busy CPU with every sandbox idle (the guests' own ticks, the services);
  3. one client alone, `--solo-seconds`: its operations per second and the host's CPU seconds
     per operation above rest;
  4. every client at once, `--seconds`: operations per second in all, latency percentiles,
     errors, and the memory (RSS) of the API, the controller, the worker and its gateway,
     sampled every `--sample` seconds. Each client's first command, which wakes a guest that
     sat idle, is timed apart from the steady run;
  5. where the CPU went in both runs, per operation: each service, every VMM, PostgreSQL and
     this process (the clients).

An operation is a command (`true`, through the API's NDJSON exec) or a file write (4 KiB, `PUT
/files`), in turn. The baseline is what the lone client's rate allows: `clients` times its rate,
bounded by the CPUs (the cores left at rest over its CPU seconds per operation), since every
operation costs the host's two cores work that no concurrency removes.

Run as root:  .venv/bin/python bench/many_clients.py [--clients 32] [--seconds 600]
                  [--json bench/results/many_clients.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from services import UNLIMITED, BenchPlatform, platform
from space.db.store import Store
from vm_runtime import percentile_table, percentiles

SHAPE = {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024, "timeout_s": 7200}
FILE = os.urandom(4096)


async def setup(store: Store) -> dict[str, str]:
    tenant = await store.create_tenant(f"bench-clients-{secrets.token_hex(3)}")
    return {"key": await store.create_api_key(tenant.id)}


def busy_seconds() -> float:
    """CPU seconds the host has spent on anything but idling, over all cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:  # ended meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pgrep(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def cpu_by_part(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each service, of every VMM, of PostgreSQL and of this client."""
    parts = {name: cpu_seconds(pid) for name, pid in pids.items()}
    parts["vmms"] = sum(cpu_seconds(pid) for pid in pgrep("qemu-system"))
    parts["postgres"] = sum(cpu_seconds(pid) for pid in pgrep("postgres"))
    parts["clients"] = cpu_seconds(os.getpid())
    return parts


def services(p: BenchPlatform) -> dict[str, int]:
    """The pids whose memory must stay flat: the API, controller, worker and its gateway."""
    pids = {name: p.procs[name].pid for name in ("api", "controller", "worker")}
    pids["gateway"] = pgrep(f"gateway-{p.worker_id} ")[0]
    return pids


class Client:
    """One client's loop over its own sandbox: a command, then a file write, until `until`."""

    def __init__(self, http: httpx.AsyncClient, sid: str) -> None:
        self.http, self.sid = http, sid
        self.commands: list[float] = []
        self.writes: list[float] = []
        self.errors: list[str] = []
        self.first = 0.0

    async def command(self) -> None:
        code = None
        async with self.http.stream("POST", f"/v1/sandboxes/{self.sid}/exec",
                                    json={"argv": ["true"]}) as r:  # fmt: skip
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if line and (event := json.loads(line))["type"] == "exit":
                    code = event["exit_code"]
        if code != 0:
            raise RuntimeError(f"exit {code}")

    async def write(self) -> None:
        r = await self.http.put(f"/v1/sandboxes/{self.sid}/files",
                                params={"path": "/root/note"}, content=FILE)  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:200]}")

    async def loop(self, until: float) -> None:
        # The first command wakes a guest that sat idle: timed on its own, not in the steady run.
        t = time.perf_counter()
        try:
            await self.command()
        except (httpx.HTTPError, RuntimeError) as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
        self.first = time.perf_counter() - t
        while time.perf_counter() < until:
            for op, samples in ((self.command, self.commands), (self.write, self.writes)):
                t = time.perf_counter()
                try:
                    await op()
                except (httpx.HTTPError, RuntimeError) as e:
                    self.errors.append(f"{type(e).__name__}: {e}"[:200])
                    continue
                samples.append(time.perf_counter() - t)


async def phase(
    http: httpx.AsyncClient, sids: list[str], seconds: float, sample: float, pids: dict[str, int]
) -> dict[str, Any]:
    clients = [Client(http, sid) for sid in sids]
    memory: list[dict[str, float]] = []
    busy, cpu, t0 = busy_seconds(), cpu_by_part(pids), time.perf_counter()
    until = t0 + seconds
    work = asyncio.gather(*(c.loop(until) for c in clients))
    while not work.done():
        memory.append({"t": time.perf_counter() - t0,
                       **{name: rss_mib(pid) for name, pid in pids.items()}})  # fmt: skip
        await asyncio.wait([work], timeout=sample)
    await work
    elapsed = time.perf_counter() - t0
    cpu = {name: seconds - cpu[name] for name, seconds in cpu_by_part(pids).items()}
    commands = [s for c in clients for s in c.commands]
    writes = [s for c in clients for s in c.writes]
    errors = [e for c in clients for e in c.errors]
    ops = max(1, len(commands) + len(writes))
    return {
        "clients": len(clients),
        "seconds": elapsed,
        "ops_per_s": (len(commands) + len(writes)) / elapsed,
        "commands_per_s": len(commands) / elapsed,
        "busy_cores": (busy_seconds() - busy) / elapsed,
        "cpu_ms_per_op": {name: s * 1000 / ops for name, s in cpu.items()},
        "command": percentiles(commands),
        "file_write": percentiles(writes),
        "all_ops": percentiles(commands + writes),
        "first_command_after_rest": percentiles([c.first for c in clients]),
        "errors": len(errors),
        "first_errors": errors[:5],
        "memory": memory,
    }


def flatness(memory: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per service: the median RSS of the run's first fifth (after its first sample, which may
    precede the load) against its last fifth."""
    samples = memory[1:] or memory
    fifth = max(1, len(samples) // 5)
    out = {}
    for name in samples[0]:
        if name == "t":
            continue
        first = statistics.median(s[name] for s in samples[:fifth])
        last = statistics.median(s[name] for s in samples[-fifth:])
        peak = max(s[name] for s in samples)
        out[name] = {"first_mib": first, "last_mib": last, "peak_mib": peak,
                     "growth_mib": last - first}  # fmt: skip
    return out


async def run(p: BenchPlatform, key: str, args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=p.url, headers=headers, timeout=120,
                                 limits=limits) as http:  # fmt: skip
        sids = []
        for _ in range(args.clients):
            r = await http.post("/v1/sandboxes", json=SHAPE)
            assert r.status_code == 201 and r.json()["state"] == "running", r.text
            sids.append(r.json()["id"])
        pids = services(p)
        await asyncio.sleep(5)  # the last creates' work done
        busy, t = busy_seconds(), time.perf_counter()
        await asyncio.sleep(args.rest_seconds)
        rest_cores = (busy_seconds() - busy) / (time.perf_counter() - t)
        solo = await phase(http, sids[:1], args.solo_seconds, args.sample, pids)
        many = await phase(http, sids, args.seconds, args.sample, pids)
        for sid in sids:
            await http.delete(f"/v1/sandboxes/{sid}", params={"wait": "false"})
    cpu_per_op = max(solo["busy_cores"] - rest_cores, 1e-9) / solo["ops_per_s"]
    cpu_bound = (os.cpu_count() or 1) - rest_cores
    expected = min(args.clients * solo["ops_per_s"], cpu_bound / cpu_per_op)
    phases = (("solo", solo), ("many", many))
    platform_ms = {name: sum(ms for part, ms in ph["cpu_ms_per_op"].items() if part != "vmms")
                   for name, ph in phases}  # fmt: skip
    return {
        "clients": args.clients,
        "cpus": os.cpu_count(),
        "rest_busy_cores": rest_cores,
        "solo": solo,
        "many": many,
        "cpu_s_per_op": cpu_per_op,
        "expected_ops_per_s": expected,
        "ratio_to_expected": many["ops_per_s"] / expected,
        "p99_over_p50": many["all_ops"]["p99_ms"] / many["all_ops"]["p50_ms"],
        "memory": flatness(many["memory"]),
        "platform_cpu_ms_per_op": platform_ms,
        "vmm_cpu_ms_per_op": {name: ph["cpu_ms_per_op"]["vmms"] for name, ph in phases},
    }


def table(r: dict[str, Any]) -> str:
    solo, many = r["solo"], r["many"]
    named = {f"solo {k}": v for k, v in solo.items()}
    named |= {f"{r['clients']} clients {k}": v for k, v in many.items()}
    lines = percentile_table(named)
    lines += [
        "",
        f"at rest with {r['clients']} idle sandboxes: {r['rest_busy_cores']:.2f} of "
        f"{r['cpus']} cores busy",
        f"one client: {solo['ops_per_s']:.1f} ops/s, {r['cpu_s_per_op'] * 1000:.1f} ms of CPU "
        "per op above rest",
        f"{r['clients']} clients: {many['ops_per_s']:.1f} ops/s "
        f"({many['commands_per_s']:.1f} commands/s), {many['busy_cores']:.2f} cores busy, "
        f"{many['errors']} errors",
        f"expected (min of {r['clients']} x one client, CPU-bound): "
        f"{r['expected_ops_per_s']:.1f} ops/s -> ratio {r['ratio_to_expected']:.2f}",
        f"p99 / p50 over every op: {r['p99_over_p50']:.2f}",
        "",
        f"{'CPU ms per op':<14}{'one client':>12}{str(r['clients']) + ' clients':>12}",
        *(
            f"{name:<14}{solo['cpu_ms_per_op'][name]:>12.1f}{ms:>12.1f}"
            for name, ms in many["cpu_ms_per_op"].items()
        ),
        "",
        f"{'RSS MiB':<12}{'first':>10}{'last':>10}{'peak':>10}{'growth':>10}",
    ]
    for name, m in r["memory"].items():
        lines.append(f"{name:<12}{m['first_mib']:>10.1f}{m['last_mib']:>10.1f}"
                     f"{m['peak_mib']:>10.1f}{m['growth_mib']:>+10.1f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    os.environ.update(UNLIMITED)  # the services inherit them: no test of quotas here
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=120, help="of every client at once")
    parser.add_argument("--solo-seconds", type=float, default=30)
    parser.add_argument("--rest-seconds", type=float, default=10)
    parser.add_argument("--sample", type=float, default=10, help="seconds between RSS samples")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with platform(setup) as (p, keys):
        p.wait_worker(keys["key"])
        results = asyncio.run(run(p, keys["key"], args))
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

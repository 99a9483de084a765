"""Spin-up benchmark: what a create costs from the client's side, by the path it takes.

  - warm-pool hit: the template's pool has ready members (the bench waits, untimed, for the
    pool to be full again between creates, so each create is a hit that no refill competes
    with; the bursts below show creates and refills together)
  - pool miss: no pool, so the create restores the template's base snapshot, whose memory
    file the restore maps (the default); and, as the baseline, the same with the guest's
    memory copied out of QEMU's stream first (SPACE_WORKER_MAPPED_MEMORY=0)
  - cold boot: a worker with base snapshots turned off (SPACE_WORKER_BASE_SNAPSHOTS=0) boots
    every sandbox
  - the VMM jail's cost: pool hits, misses and the PSS of an idle sandbox's VMM, jailed (the
    default) and, as the baseline, unjailed (SPACE_WORKER_JAIL=0)
For each: the create call until it answers with a running sandbox, and create until the first
command's answer; then creates per second with 8 concurrent clients (create, first exec,
delete), with and without a pool (and without one on copied memory). All phases run in one run,
on one platform: embedded PostgreSQL, one worker, controller and API as separate processes.

Run as root:  .venv/bin/python bench/spinup.py [--creates 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services import UNLIMITED, BenchPlatform, platform
from space.db.store import Store
from vm_runtime import percentile_table, percentiles

SHAPE = {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024}
CONCURRENCY = 8


async def setup(store: Store) -> dict[str, str]:
    tenant = await store.create_tenant("bench")
    admin = await store.create_tenant("bench-ops")
    return {
        "key": await store.create_api_key(tenant.id),
        "admin": await store.create_api_key(admin.id, admin=True),
    }


def first_exec(c: httpx.Client, sid: str) -> None:
    with c.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
        assert json.loads(lines[-1])["type"] == "exit", lines


def create_and_exec(c: httpx.Client) -> tuple[float, float, str]:
    """Seconds to the running sandbox, seconds to its first exec answered, and its path."""
    t = time.perf_counter()
    r = c.post("/v1/sandboxes", json=SHAPE)
    created = time.perf_counter() - t
    assert r.status_code == 201 and r.json()["state"] == "running", r.text
    sb = r.json()
    first_exec(c, sb["id"])
    total = time.perf_counter() - t
    c.delete(f"/v1/sandboxes/{sb['id']}", params={"wait": "false"})
    return created, total, str(sb["boot"])


def set_pool(p: BenchPlatform, admin: str, size: int) -> None:
    with p.client(admin) as c:
        r = c.put("/v1/templates/base/pool", json={"size": size, **SHAPE})
        assert r.status_code == 200, r.text


def wait_pool(p: BenchPlatform, admin: str, ready: int, within_s: float | None = None) -> bool:
    """Until the pool has `ready` members ready (at least; exactly, for an empty pool); False
    if it has not within `within_s` (None: however long it takes)."""
    deadline = None if within_s is None else time.monotonic() + within_s
    with p.client(admin) as c:
        while True:
            have = c.get("/v1/templates/base").json()["pool"]["ready"]
            if have >= ready and (ready > 0 or have == 0):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)


@dataclass
class Run:
    create: list[float] = field(default_factory=list)
    first_exec: list[float] = field(default_factory=list)
    paths: Counter[str] = field(default_factory=Counter)


def sequential(p: BenchPlatform, key: str, n: int, before: Callable[[], None] | None = None) -> Run:
    run = Run()
    with p.client(key) as c:
        for _ in range(n):
            if before:
                before()
            created, total, path = create_and_exec(c)
            run.paths[path] += 1
            run.create.append(created)
            run.first_exec.append(total)
    return run


def idle_pss(p: BenchPlatform, key: str, n: int) -> dict[str, Any]:
    """PSS (MiB) of the VMMs of n sandboxes that each answered a command and then idled."""
    with p.client(key) as c:
        made = []
        for _ in range(n):
            r = c.post("/v1/sandboxes", json=SHAPE)
            assert r.status_code == 201, r.text
            made.append(r.json()["id"])
            first_exec(c, made[-1])
        time.sleep(5)
        figures = [_pss_mib(sid) for sid in made]
        for sid in made:
            c.delete(f"/v1/sandboxes/{sid}")
    return {"sandboxes": n, "pss_mib_mean": sum(figures) / len(figures), "pss_mib": figures}


def _pss_mib(sid: str) -> float:
    needle = f"/vms/{sid}/".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if cmdline.startswith(b"qemu-system") and needle in cmdline:
                for line in (proc / "smaps_rollup").read_text().splitlines():
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            continue
    raise RuntimeError(f"no VMM found for {sid}")


def burst(p: BenchPlatform, key: str, n: int) -> dict[str, Any]:
    """n creates (each: create, first exec, delete) by CONCURRENCY clients at once."""

    def worker(count: int) -> list[tuple[float, float, str]]:
        with p.client(key) as c:
            return [create_and_exec(c) for _ in range(count)]

    per = [n // CONCURRENCY + (i < n % CONCURRENCY) for i in range(CONCURRENCY)]
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as ex:
        results = [r for rs in ex.map(worker, per) for r in rs]
    took = time.perf_counter() - t
    return {
        "creates": n,
        "clients": CONCURRENCY,
        "seconds": took,
        "creates_per_s": n / took,
        "paths": dict(Counter(r[2] for r in results)),
        "create": percentiles([r[0] for r in results]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=200, help="per path")
    parser.add_argument("--cold", type=int, default=None, help="cold boots (default: --creates)")
    parser.add_argument("--pool", type=int, default=4, help="pool size for the sequential hits")
    parser.add_argument("--burst", type=int, default=96, help="creates per concurrent phase")
    parser.add_argument("--burst-pool", type=int, default=16)
    parser.add_argument("--idle", type=int, default=8, help="sandboxes whose PSS is measured")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.update(UNLIMITED)  # its pool polls would pass the default rate limit
    results: dict[str, Any] = {}
    paths: dict[str, Any] = {}
    with platform(setup) as (p, keys):
        key, admin = keys["key"], keys["admin"]
        p.wait_worker(key)  # builds the worker's base snapshot of the 128 MiB shape
        with p.client(key) as c:  # and of ours: a cold boot, not part of any figure
            create_and_exec(c)

        set_pool(p, admin, args.pool)
        wait_pool(p, admin, args.pool)
        runs = {"hit": sequential(p, key, args.creates, lambda: wait_pool(p, admin, args.pool))}

        set_pool(p, admin, 0)
        wait_pool(p, admin, 0)
        runs["miss"] = sequential(p, key, args.creates)
        results["idle_pss"] = idle_pss(p, key, args.idle)

        results["burst_no_pool"] = burst(p, key, args.burst)
        set_pool(p, admin, args.burst_pool)
        wait_pool(p, admin, args.burst_pool)
        results["burst_pool"] = burst(p, key, args.burst)
        set_pool(p, admin, 0)
        wait_pool(p, admin, 0)

        p.stop("worker")
        p.start_worker(SPACE_WORKER_MAPPED_MEMORY="0")
        p.wait_worker(key)
        with p.client(key) as c:  # a base snapshot of copied memory: not part of any figure
            create_and_exec(c)
        runs["miss_copied"] = sequential(p, key, args.creates)
        results["burst_no_pool_copied"] = burst(p, key, args.burst)

        p.stop("worker")
        p.start_worker(SPACE_WORKER_JAIL="0")
        p.wait_worker(key)
        with p.client(key) as c:  # its own base snapshot: not part of any figure
            create_and_exec(c)
        set_pool(p, admin, args.pool)
        wait_pool(p, admin, args.pool)
        runs["hit_unjailed"] = sequential(
            p, key, args.creates, lambda: wait_pool(p, admin, args.pool)
        )
        set_pool(p, admin, 0)
        wait_pool(p, admin, 0)
        runs["miss_unjailed"] = sequential(p, key, args.creates)
        results["idle_pss_unjailed"] = idle_pss(p, key, args.idle)

        p.stop("worker")
        p.start_worker(SPACE_WORKER_BASE_SNAPSHOTS="0")
        p.wait_worker(key)
        runs["cold"] = sequential(p, key, args.cold if args.cold is not None else args.creates)
    for name, run in runs.items():
        results[f"{name}_create"] = percentiles(run.create)
        results[f"{name}_create_to_first_exec"] = percentiles(run.first_exec)
        paths[name] = dict(run.paths)
    results["paths"] = paths
    lines = percentile_table(results)
    for name in ("burst_no_pool", "burst_no_pool_copied", "burst_pool"):
        b = results[name]
        lines.append(
            f"{name}: {b['creates']} creates by {b['clients']} clients: "
            f"{b['creates_per_s']:.1f} creates/s, create p50 {b['create']['p50_ms']:.0f} ms "
            f"p90 {b['create']['p90_ms']:.0f} ms, paths {b['paths']}"
        )
    for name in ("idle_pss", "idle_pss_unjailed"):
        lines.append(f"{name}: {results[name]['pss_mib_mean']:.1f} MiB per idle sandbox's VMM "
                     f"({results[name]['sandboxes']} sandboxes)")  # fmt: skip
    lines.append(f"paths taken: {paths}")
    print("\n".join(lines))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

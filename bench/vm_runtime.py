"""MicroVM runtime benchmark: boot vs restore, snapshots, exec round trip, stdout throughput.

Every figure has a baseline measured in the same run:
  - restore to first exec  vs  cold boot to first exec
  - exec round trip in a VM  vs  the same agent on the host (no VM) and a bare agent ping
  - stdout throughput from a VM  vs  from the same agent on the host

Run as root:  .venv/bin/python bench/vm_runtime.py [--execs 200] [--restores 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from space.worker.agent_client import AgentClient
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import Machine

STDOUT_BYTES = 50_000_000


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {
        "n": len(ordered),
        "p50_ms": pick(0.5) * 1000,
        "p90_ms": pick(0.9) * 1000,
        "p99_ms": pick(0.99) * 1000,
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


async def timed(n: int, fn: Callable[[], Awaitable[object]]) -> list[float]:
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - t)
    return samples


async def stdout_rate(agent: AgentClient) -> float:
    t = time.perf_counter()
    r = await agent.run(f"head -c {STDOUT_BYTES} /dev/zero", timeout=600, max_output=STDOUT_BYTES)
    elapsed = time.perf_counter() - t
    assert len(r.stdout) == STDOUT_BYTES, len(r.stdout)
    return STDOUT_BYTES / elapsed / 1e6


async def host_agent(tmp: Path) -> tuple[asyncio.subprocess.Process, AgentClient]:
    """The same agent code on the host: the no-VM baseline."""
    sock, token_file = tmp / "agent.sock", tmp / "token"
    token_file.write_text("bench-token-0123456789")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "space.guest.agent", "--listen-unix", str(sock),
        "--token-file", str(token_file), stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    while not sock.exists():  # noqa: ASYNC110 - the agent makes the socket; nothing to await
        await asyncio.sleep(0.01)
    client = await AgentClient.connect(
        lambda: asyncio.open_unix_connection(str(sock)), "bench-token-0123456789"
    )
    return proc, client


async def bench(rt: LocalRuntime, execs: int, restores: int, boots: int) -> dict[str, Any]:
    out: dict[str, Any] = {}

    async def boot_and_exec() -> None:
        async with await Machine.boot(rt.driver, rt.pool, rt.images) as m:
            await m.agent.run(["true"])

    print(f"cold boots: {boots}", file=sys.stderr)
    out["cold_boot_to_first_exec"] = percentiles(await timed(boots, boot_and_exec))

    origin = await Machine.boot(rt.driver, rt.pool, rt.images)
    await origin.agent.run(["true"])
    snap_dir = rt.pool.snapshots / f"bench-{origin.id}"
    snap = await origin.snapshot(snap_dir)
    state = snap.path / snap.files["state"]
    out["snapshot"] = {
        "took_ms": snap.took_s * 1000,
        "memory_mib": origin.vm.config.memory_mib,
        "state_file_mb": state.stat().st_size / 1e6,
    }
    await origin.close()

    print(f"restores: {restores}", file=sys.stderr)
    samples = []  # timed from the call to the answered exec; teardown is not counted
    for _ in range(restores):
        t = time.perf_counter()
        m = await Machine.restore(rt.driver, rt.pool, snap)
        await m.agent.run(["true"])
        samples.append(time.perf_counter() - t)
        await m.close()
    out["restore_to_first_exec"] = percentiles(samples)

    async with await Machine.restore(rt.driver, rt.pool, snap) as m:
        print(f"exec round trips: {execs}", file=sys.stderr)
        out["vm_exec_true"] = percentiles(await timed(execs, lambda: m.agent.run(["true"])))
        out["vm_agent_ping"] = percentiles(await timed(execs, m.agent.ping))
        out["vm_stdout_mb_s"] = await stdout_rate(m.agent)
    shutil.rmtree(snap_dir)

    with tempfile.TemporaryDirectory() as tmp:
        proc, client = await host_agent(Path(tmp))
        try:
            out["host_exec_true"] = percentiles(await timed(execs, lambda: client.run(["true"])))
            out["host_agent_ping"] = percentiles(await timed(execs, client.ping))
            out["host_stdout_mb_s"] = await stdout_rate(client)
        finally:
            await client.close()
            proc.terminate()
            await proc.wait()
    return out


def percentile_table(results: dict[str, Any]) -> list[str]:
    """The lines of a table of every percentile figure in `results`."""
    rows = [("measure", "n", "p50 ms", "p90 ms", "p99 ms")]
    for key, val in results.items():
        if isinstance(val, dict) and "p50_ms" in val:
            rows.append(
                (key, str(val["n"]), *(f"{val[k]:.1f}" for k in ("p50_ms", "p90_ms", "p99_ms")))
            )
    width = max(len(r[0]) for r in rows) + 2
    return [
        "  ".join(f"{c:<{width}}" if i == 0 else f"{c:>8}" for i, c in enumerate(r)) for r in rows
    ]


def table(results: dict[str, Any]) -> str:
    lines = percentile_table(results)
    s = results["snapshot"]
    lines.append(
        f"snapshot of a {s['memory_mib']} MiB VM: {s['took_ms']:.0f} ms, "
        f"state file {s['state_file_mb']:.1f} MB"
    )
    lines.append(
        f"stdout throughput: VM {results['vm_stdout_mb_s']:.1f} MB/s, "
        f"host agent {results['host_stdout_mb_s']:.1f} MB/s"
    )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--restores", type=int, default=20)
    parser.add_argument("--boots", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    results = await bench(rt, args.execs, args.restores, args.boots)
    results["host"] = {
        "accel": rt.driver.accel,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
    }
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())

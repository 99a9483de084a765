"""Checkpoints and forks of a sandbox that has touched 200 MiB of memory, on one worker.

Every figure has a baseline measured in the same run:
  - the guest's pause for a checkpoint  vs  a suspend and resume of the same VM (the way to keep
    its state before checkpoints)
  - a fork into K running children  vs  the same fork as it was before forks mapped memory
    (every child copying the stream), vs K creates (restores of the base snapshot) at once,
    and vs a fork of an idle VM of the same shape; with the children's PSS both ways

The worker's sandbox manager is driven directly (no HTTP, no network namespaces: a fork through
the API adds its calls and ~30 ms of network set-up per child, in parallel).

Run as root:  .venv/bin/python bench/checkpoints.py [--runs 10] [--children 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import platform
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from report import emit
from space.worker.agent_client import AgentClient, AgentError
from space.worker.local import local_runtime
from space.worker.sandboxes import ManagerOptions, VMManager
from space.worker.sandboxes.forks import Child
from space.worker.sandboxes.usage import pss_bytes

MEMORY_MIB = 512
TOUCH_MIB = 200
# A process that holds TOUCH_MIB of non-zero pages (QEMU skips zero pages in its stream).
TOUCH = (
    "nohup python3 -c 'import time; b = bytearray({mib} << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    'open("/tmp/touched", "w").write("ok"); time.sleep(1e9)\' >/dev/null 2>&1 &'
)


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"n": len(ordered), "p50_ms": pick(0.5), "p90_ms": pick(0.9), "max_ms": ordered[-1],
            "mean_ms": statistics.fmean(ordered)}  # fmt: skip


async def timed_ms(fn: Callable[[], Awaitable[object]]) -> float:
    t = time.perf_counter()
    await fn()
    return (time.perf_counter() - t) * 1000


async def touch(agent: AgentClient, mib: int) -> None:
    """Start a guest process that holds `mib` MiB of non-zero pages, and wait until it does."""
    await agent.run(["/bin/sh", "-c", TOUCH.format(mib=mib)], timeout=30)
    for _ in range(600):
        if (await agent.run(["cat", "/tmp/touched"], timeout=10)).stdout == b"ok":
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the guest did not touch its memory")


async def largest_gap_ms(
    m: VMManager, vm_id: str, during: Callable[[], Awaitable[object]]
) -> float:
    """The longest silence, seen from the host, of a guest process printing every 2 ms while
    `during` runs: how long the guest stood still for it (the guest's own clock stops with it
    under QEMU, so only the host can tell)."""
    printer = "import time\nwhile True: print(1); time.sleep(0.002)"
    proc = await m.exec(vm_id, ["python3", "-u", "-c", printer])
    arrivals: list[float] = []

    async def read() -> None:
        with contextlib.suppress(AgentError):  # the process is killed at the end
            async for _stream, _data in proc:
                arrivals.append(time.perf_counter())

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.5)
    start = time.perf_counter()
    await during()
    end = time.perf_counter()
    await asyncio.sleep(0.2)
    await proc.signal(9)
    reader.cancel()
    seen = [t for t in arrivals if start - 0.1 <= t <= end + 0.1]
    return max(b - a for a, b in itertools.pairwise(seen)) * 1000


async def bench(m: VMManager, runs: int, k: int) -> dict[str, Any]:
    await m.create("warmup", memory_mib=MEMORY_MIB)  # builds the base snapshot of this shape
    await m.delete("warmup")
    await m.create("busy", memory_mib=MEMORY_MIB)
    busy = m.get("busy").machine
    assert busy is not None
    await touch(busy.agent, TOUCH_MIB)
    await m.create("idle", memory_mib=MEMORY_MIB)
    out: dict[str, Any] = {}

    paused, took, sizes = [], [], []
    for i in range(runs):
        t = time.perf_counter()
        taken = await m.checkpoint("busy", f"c{i}")
        took.append((time.perf_counter() - t) * 1000)
        paused.append(taken.paused_ms)
        sizes.append(taken.size_bytes)
        await m.delete_checkpoint("busy", f"c{i}")
    gaps = []
    for i in range(runs):
        gaps.append(await largest_gap_ms(m, "busy", lambda i=i: m.checkpoint("busy", f"g{i}")))
        await m.delete_checkpoint("busy", f"g{i}")
    quiet = [await largest_gap_ms(m, "busy", lambda: asyncio.sleep(1.0)) for _ in range(runs)]
    out["checkpoint_paused"] = stats(paused)
    out["checkpoint_gap_seen"] = stats(gaps)
    out["baseline_gap_without"] = stats(quiet)
    out["checkpoint_call"] = stats(took)
    out["checkpoint_size_mb"] = statistics.median(sizes) / 1e6
    print(f"checkpoint pause: {out['checkpoint_paused']}", file=sys.stderr)

    suspend, resume = [], []
    for _ in range(max(3, runs // 3)):
        suspend.append(await timed_ms(lambda: m.suspend("busy")))
        resume.append(await timed_ms(lambda: m.resume("busy")))
    out["baseline_suspend"] = stats(suspend)
    out["baseline_resume"] = stats(resume)

    pss: dict[str, list[float]] = {"mapped": [], "copied": []}

    async def fork_of(vm_id: str, copied: bool = False) -> float:
        """A fork's time; with `copied`, as forks were before: every child copies the stream."""
        kids = [Child(f"k{uuid.uuid4().hex[:6]}", "kid", {}) for _ in range(k)]
        mapped = m.driver.mapped_memory
        m.driver.mapped_memory = mapped and not copied
        try:
            t = time.perf_counter()
            made, _ = await m.fork(vm_id, kids)
            elapsed = (time.perf_counter() - t) * 1000
        finally:
            m.driver.mapped_memory = mapped
        assert len(made) == k and all(sb.state == "running" for sb in made)
        if vm_id == "busy":
            pids = [sb.machine.status().pid for sb in made if sb.machine is not None]
            total = sum(pss_bytes(pid) or 0 for pid in pids if pid is not None)
            pss["copied" if copied else "mapped"].append(total / k / (1 << 20))
        for sb in made:
            await m.delete(sb.id)
        return elapsed

    async def creates() -> float:
        ids = [f"c{uuid.uuid4().hex[:6]}" for _ in range(k)]
        t = time.perf_counter()
        await asyncio.gather(*(m.create(i, memory_mib=MEMORY_MIB) for i in ids))
        elapsed = (time.perf_counter() - t) * 1000
        for i in ids:
            await m.delete(i)
        return elapsed

    forks, copied, idle_forks, base = [], [], [], []
    for _ in range(max(3, runs // 2)):
        forks.append(await fork_of("busy"))
        copied.append(await fork_of("busy", copied=True))
        idle_forks.append(await fork_of("idle"))
        base.append(await creates())
    out[f"fork_{k}_busy"] = stats(forks)
    out[f"baseline_fork_{k}_busy_copied"] = stats(copied)
    out[f"fork_{k}_idle"] = stats(idle_forks)
    out[f"baseline_{k}_creates"] = stats(base)
    out["fork_child_pss_mib"] = {how: statistics.median(v) for how, v in pss.items() if v}
    print(f"fork: {out[f'fork_{k}_busy']}", file=sys.stderr)
    return out


def table(results: dict[str, Any], k: int) -> str:
    rows = [
        ("guest paused for a checkpoint (200 MiB touched)", "checkpoint_paused"),
        (
            "longest silence of a guest printing every 2 ms, across a checkpoint",
            "checkpoint_gap_seen",
        ),
        ("baseline: the same over 1 s without a checkpoint", "baseline_gap_without"),
        ("checkpoint call, all of it (sync, snapshot, fsync, rename)", "checkpoint_call"),
        ("baseline: suspend of the same VM", "baseline_suspend"),
        ("baseline: resume of the same VM", "baseline_resume"),
        (f"fork into {k} running children (200 MiB touched)", f"fork_{k}_busy"),
        (
            "baseline: the same fork, each child copying the stream",
            f"baseline_fork_{k}_busy_copied",
        ),
        (f"fork into {k} running children (idle VM)", f"fork_{k}_idle"),
        (f"baseline: {k} creates at once (restores of the base snapshot)", f"baseline_{k}_creates"),
    ]
    lines = ["| measure | p50 | p90 | max |", "|---|---|---|---|"]
    for label, key in rows:
        s = results[key]
        lines.append(f"| {label} | {s['p50_ms']:,.0f} ms | {s['p90_ms']:,.0f} ms | "
                     f"{s['max_ms']:,.0f} ms |")  # fmt: skip
    lines.append(f"\ncheckpoint size on the pool: {results['checkpoint_size_mb']:.0f} MB")
    for how, mib in results["fork_child_pss_mib"].items():
        lines.append(f"PSS per child of a fork of the busy VM, {how}: {mib:.0f} MiB")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--json", type=str, help="also write the results here")
    args = parser.parse_args()
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    worker_id = f"bench-ck-{uuid.uuid4().hex[:6]}"
    m = VMManager(rt.driver, rt.pool, rt.images, worker_id,
                  ManagerOptions(capacity_vcpus=32, capacity_memory_mib=16384))  # fmt: skip
    await m.start()
    try:
        results = await bench(m, args.runs, args.children)
    finally:
        await m.close(stop_vms=True)
        shutil.rmtree(m.root, ignore_errors=True)
    results["host"] = {"cpus": os.cpu_count(), "machine": platform.machine(),
                       "accel": getattr(rt.driver, "accel", "?")}  # fmt: skip
    print(table(results, args.children))
    emit(results, args.json)


if __name__ == "__main__":
    asyncio.run(main())

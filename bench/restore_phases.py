"""Where a restore of a base snapshot spends its time, on one worker: the phases of
`Machine.restore` (disk clone, VMM start and state load, the agent's first answer, the new
identity), then the first command in the new guest, against the baseline of a second command
in the same guest (its code already translated: under TCG a new QEMU process starts with an
empty translation cache, and the guest's first run of every path pays for it).

The worker's sandbox manager is driven directly (no HTTP, no network namespaces).

Run as root:  .venv/bin/python bench/restore_phases.py [--creates 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import time
import uuid

from report import emit
from space.worker.local import local_runtime
from space.worker.sandboxes import ManagerOptions, VMManager

PHASES = ("disk", "vmm", "hello", "identity")


async def measure(m: VMManager, creates: int) -> dict[str, list[float]]:
    await m.create("warmup")  # builds the base snapshot of this shape
    await m.delete("warmup")
    samples: dict[str, list[float]] = {k: [] for k in (*PHASES, "create", "exec1", "exec2")}
    for i in range(creates):
        vm_id = f"r{i}-{uuid.uuid4().hex[:4]}"
        t = time.perf_counter()
        sb = await m.create(vm_id)
        samples["create"].append(time.perf_counter() - t)
        machine = sb.live_machine("bench")
        for phase in PHASES:
            samples[phase].append(machine.timings[phase])
        for run in ("exec1", "exec2"):
            t = time.perf_counter()
            await machine.agent.run("true")
            samples[run].append(time.perf_counter() - t)
        await m.delete(vm_id)
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--json", type=str, help="also write the results here")
    args = parser.parse_args()
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    m = VMManager(rt.driver, rt.pool, rt.images, f"bench-phases-{uuid.uuid4().hex[:6]}",
                  ManagerOptions(capacity_vcpus=32, capacity_memory_mib=16384))  # fmt: skip
    await m.start()
    try:
        samples = await measure(m, args.creates)
    finally:
        await m.close(stop_vms=True)
        shutil.rmtree(m.root, ignore_errors=True)
    labels = {
        "disk": "clone of the disk", "vmm": "VMM started, device state loaded, memory mapped",
        "hello": "the agent's first answer", "identity": "new token, hostname, clock, RNG",
        "create": "the whole create (manager)", "exec1": "first command (`true`) in the guest",
        "exec2": "baseline: the second command in the same guest",
    }  # fmt: skip
    results = {k: {"p50_ms": statistics.median(v) * 1000, "max_ms": max(v) * 1000}
               for k, v in samples.items()}  # fmt: skip
    print("| phase | p50 | max |\n|---|---|---|")
    for key, label in labels.items():
        r = results[key]
        print(f"| {label} | {r['p50_ms']:.0f} ms | {r['max_ms']:.0f} ms |")
    emit(results, args.json)


if __name__ == "__main__":
    asyncio.run(main())

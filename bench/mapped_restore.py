"""Restores that map guest memory instead of copying it: what QEMU 7.2 allows, measured.

A VM of 512 MiB that has touched 200 MiB (a process holding it) is snapshotted and restored
4 at a time (as a fork into 4 would), three ways, in the same run:
  - baseline, as the worker does for checkpoints, suspends and forks: anonymous guest RAM; the
    snapshot is QEMU's migration stream (every non-zero page); each restore reads all of it
    before the guest runs
  - mapped, private, as the worker does for base snapshots: the source VM's RAM is a file
    (`memory-backend-file,share=on`); with the `x-ignore-shared` migration capability the
    stream holds only device state, and the memory file is reflinked into the snapshot; each
    restore maps that one file privately
    (`share=off`): pages are read when the guest touches them, clones share the page cache of
    those they have not written, and writes stay in the clone's own anonymous memory
  - mapped, shared: each restore gets its own reflink of the memory file, mapped shared (so it
    could be snapshotted the same way again); no page cache is shared between clones

Each restore is timed until the guest agent answered with a new identity (Machine.restore);
PSS is read from /proc for the idle clones. The worker now restores base snapshots the
"mapped, private" way (docs/control-plane.md, "Guest memory").

Run as root:  .venv/bin/python bench/mapped_restore.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoints import MEMORY_MIB, TOUCH_MIB, touch
from report import emit
from space.worker.local import local_runtime
from space.worker.machine import Machine
from space.worker.storage.reflink import clone_file
from space.worker.vmm.base import MEMORY_FILE, VM, SnapshotInfo, VMConfig, VMMError
from space.worker.vmm.qemu import STATE_FD, QemuDriver

CLONES = 4
IGNORE_SHARED = {"capabilities": [{"capability": "x-ignore-shared", "state": True}]}


class FileMemory(QemuDriver):
    """The worker's QEMU driver, whose snapshot sources keep RAM in a file that restores map
    privately; and, for the third way, restores that map a file of their own shared."""

    def __init__(self, base: QemuDriver) -> None:
        # No balloon: QEMU 7.2 would punch holes in the memory files.
        super().__init__(base.binary, base.accel, base.guest_aslr, free_page_reporting=False,
                         mapped_memory=True)  # fmt: skip
        # A restore's own memory file, mapped shared; None: the driver's own restores.
        self.memory: Callable[[str], Path] | None = None

    async def restore(
        self, snapshot: SnapshotInfo, config: VMConfig, run_dir: Path, *, paused: bool = False
    ) -> VM:
        if self.memory is None:
            return await super().restore(snapshot, config, run_dir, paused=paused)
        own = config.with_changes(memory_file=self.memory(config.vm_id), memory_shared=True)
        # The capability must be set on both sides before the stream is read: defer it.
        state = snapshot.path / snapshot.files["state"]
        vm = await self._launch(own, run_dir, ["-incoming", "defer"], {STATE_FD: state})
        await vm._execute("migrate-set-capabilities", IGNORE_SHARED)
        await vm._execute("migrate-incoming", {"uri": f"fd:{STATE_FD}"})
        while (status := await vm.query_status()) != "running":
            if status == "paused":
                await vm._execute("cont")
            elif status not in ("inmigrate", "prelaunch", "restore-vm"):
                raise VMMError(f"restore ended in state {status!r}")
            await asyncio.sleep(0.002)
        vm.mark_running()
        return vm


def pss_mib(vm: VM) -> float:
    pid = vm.status().pid
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no PSS for {pid}")


async def source(driver: FileMemory, rt: Any, root: Path, mapped: bool) -> tuple[Path, float]:
    """A booted VM that touched TOUCH_MIB, snapshotted into root/snap; its pause (ms)."""
    vms = root / "vms"
    driver.memory = None
    m = await Machine.boot(driver, rt.pool, rt.images, vm_id="src", memory_mib=MEMORY_MIB,
                           vms_dir=vms, snapshot_source=mapped)  # fmt: skip
    try:
        await touch(m.agent, TOUCH_MIB)
        await m.agent.sync()
        snap = root / "snap"
        if m.vm.config.memory_file is not None:
            # Flush the guest's dirty pages to the file while it runs, so that the clone
            # made while it is paused has little left to write.
            await asyncio.to_thread(_flush, m.vm.config.memory_file)
        started = time.perf_counter()
        await m.vm.snapshot(snap)
        await m.vm.resume()
        return snap, (time.perf_counter() - started) * 1000
    finally:
        await m.close()


def _flush(path: Path) -> None:
    with path.open("rb+") as f:
        os.fdatasync(f.fileno())


async def clones(
    driver: FileMemory, rt: Any, root: Path, snap: Path, mode: str, rounds: int
) -> dict[str, Any]:
    vms = root / "vms"
    walls, each, pss = [], [], []
    for _ in range(rounds):
        ids = [f"c{uuid.uuid4().hex[:6]}" for _ in range(CLONES)]

        async def one(vm_id: str) -> tuple[Machine, float]:
            if mode == "shared":
                own = root / f"{vm_id}.mem"
                await asyncio.to_thread(clone_file, snap / MEMORY_FILE, own)
            t = time.perf_counter()
            m = await Machine.restore(driver, rt.pool, SnapshotInfo.load(snap), vm_id=vm_id,
                                      vms_dir=vms)  # fmt: skip
            return m, (time.perf_counter() - t) * 1000

        # The worker's restores for the first two; a reflink each, mapped shared, for the third.
        driver.memory = (lambda vm_id: root / f"{vm_id}.mem") if mode == "shared" else None
        t = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in ids))
        walls.append((time.perf_counter() - t) * 1000)
        each += [ms for _, ms in results]
        await asyncio.sleep(2)
        for m, _ in results:
            out = await m.agent.run(["/bin/sh", "-c", "cat /tmp/touched"], timeout=10)
            assert out.stdout == b"ok", out  # the process's state came along
            pss.append(pss_mib(m.vm))
        for m, _ in results:
            await m.close()
        for leftover in root.glob("c*.mem"):
            leftover.unlink()
    return {"wall_ms_p50": statistics.median(walls), "wall_ms_max": max(walls),
            "restore_ms_p50": statistics.median(each), "pss_mib_p50": statistics.median(pss),
            "rounds": rounds}  # fmt: skip


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    assert isinstance(rt.driver, QemuDriver)
    driver = FileMemory(rt.driver)
    results: dict[str, Any] = {}
    for mode in ("baseline", "private", "shared"):
        root = rt.pool.root / f"bench-mapped-{uuid.uuid4().hex[:6]}"
        (root / "vms").mkdir(parents=True)
        try:
            snap, pause_ms = await source(driver, rt, root, mapped=mode != "baseline")
            state_mb = (snap / "state.bin").stat().st_size / 1e6
            got = await clones(driver, rt, root, snap, mode, args.rounds)
            results[mode] = {**got, "snapshot_pause_ms": pause_ms, "state_mb": state_mb}
            print(mode, results[mode], file=sys.stderr)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    emit(results, args.json)


def table(results: dict[str, Any]) -> str:
    names = {
        "baseline": "baseline: anonymous RAM, migration stream (checkpoints, suspends, forks)",
        "private": "memory file, x-ignore-shared, mapped privately by all clones (base snapshots)",
        "shared": "memory file, x-ignore-shared, a reflink per clone mapped shared",
    }
    lines = [
        f"| restore of a {MEMORY_MIB} MiB VM that touched {TOUCH_MIB} MiB | {CLONES} at once "
        "(p50) | one restore (p50) | PSS per idle clone | state file | snapshot pause |",
        "|---|---|---|---|---|---|",
    ]
    for mode, label in names.items():
        r = results[mode]
        lines.append(f"| {label} | {r['wall_ms_p50']:,.0f} ms | {r['restore_ms_p50']:,.0f} ms | "
                     f"{r['pss_mib_p50']:.0f} MiB | {r['state_mb']:.1f} MB | "
                     f"{r['snapshot_pause_ms']:,.0f} ms |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    asyncio.run(main())

"""A cgroup of its own for each VMM: CPU, memory (guest RAM and the VMM's own overhead), pids and
block I/O, under `space/` in each hierarchy. cgroup v2 where the host has it unified, v1
(one hierarchy per controller) otherwise; on v1 the VMM's CPU time is accounted in a cpuacct
cgroup of its own too (v2's cpu controller does it), for operators to check metering against.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
PARENT = "space"
V1_CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "blkio")
V2_CONTROLLERS = ("cpu", "memory", "pids", "io")
PERIOD_US = 100_000
STALE_S = 60.0  # an empty cgroup this old belongs to no VMM being started


class CgroupError(OSError):
    pass


@dataclass(frozen=True)
class Limits:
    """What one VMM may take. `cpus` caps its CPU time (in cores); `weight` is its share when
    the host is busy, relative to other VMMs (100 a vCPU)."""

    memory_bytes: int
    pids: int
    cpus: float
    weight: int
    # Bytes and operations per second on the pool's device, read and write each; 0: no cap.
    io_bps: int = 0
    io_iops: int = 0
    io_device: str | None = None  # "major:minor" of the pool's block device


def unified(root: Path = ROOT) -> bool:
    return (root / "cgroup.controllers").exists()


class Cgroups:
    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self.v2 = unified(root)

    def dirs(self, name: str) -> list[Path]:
        if self.v2:
            return [self.root / PARENT / name]
        # cpu and cpuacct are often one hierarchy with two names.
        found = {(self.root / c).resolve() for c in V1_CONTROLLERS if (self.root / c).is_dir()}
        return [h / PARENT / name for h in sorted(found)]

    def create(self, name: str, limits: Limits) -> list[str]:
        """Make the VMM's cgroups with `limits`; the cgroup.procs files it is to join."""
        if self.v2:
            self._enable_v2()
        made = self.dirs(name)
        if not made:
            raise CgroupError(0, f"no cgroup hierarchy under {self.root}")
        try:
            for d in made:
                d.mkdir(parents=True, exist_ok=True)
            if self.v2:
                self._limit_v2(made[0], limits)
            else:
                self._limit_v1(name, limits)
        except OSError as e:
            self.remove(name)
            raise CgroupError(e.errno or 0, f"cannot make the VMM's cgroup {name}: {e}") from e
        return [str(d / "cgroup.procs") for d in made]

    def _enable_v2(self) -> None:
        parent = self.root / PARENT
        parent.mkdir(exist_ok=True)
        wanted = " ".join(f"+{c}" for c in V2_CONTROLLERS)
        for d in (self.root, parent):
            with contextlib.suppress(OSError):  # already on, or not ours to change
                (d / "cgroup.subtree_control").write_text(wanted)

    def _limit_v2(self, d: Path, limits: Limits) -> None:
        (d / "memory.max").write_text(str(limits.memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # kernels without swap accounting
            (d / "memory.swap.max").write_text("0")
        (d / "pids.max").write_text(str(limits.pids))
        (d / "cpu.max").write_text(f"{int(limits.cpus * PERIOD_US)} {PERIOD_US}")
        (d / "cpu.weight").write_text(str(max(1, min(10_000, limits.weight))))
        if limits.io_device and (limits.io_bps or limits.io_iops):
            caps = []
            if limits.io_bps:
                caps += [f"rbps={limits.io_bps}", f"wbps={limits.io_bps}"]
            if limits.io_iops:
                caps += [f"riops={limits.io_iops}", f"wiops={limits.io_iops}"]
            (d / "io.max").write_text(f"{limits.io_device} {' '.join(caps)}")

    def _limit_v1(self, name: str, limits: Limits) -> None:
        def put(controller: str, key: str, value: object) -> None:
            path = self.root / controller / PARENT / name / key
            if path.parent.is_dir():
                path.write_text(str(value))

        put("memory", "memory.limit_in_bytes", limits.memory_bytes)
        put("pids", "pids.max", limits.pids)
        put("cpu", "cpu.cfs_period_us", PERIOD_US)
        put("cpu", "cpu.cfs_quota_us", int(limits.cpus * PERIOD_US))
        put("cpu", "cpu.shares", max(2, limits.weight * 1024 // 100))
        if limits.io_device:
            for key, value in (("bps", limits.io_bps), ("iops", limits.io_iops)):
                if value:
                    for op in ("read", "write"):
                        put("blkio", f"blkio.throttle.{op}_{key}_device",
                            f"{limits.io_device} {value}")  # fmt: skip

    def files(self, limits: Limits) -> dict[str, str]:
        """The limits as cgroup files and values, as Firecracker's jailer takes them."""
        if self.v2:
            return {
                "memory.max": str(limits.memory_bytes),
                "pids.max": str(limits.pids),
                "cpu.max": f"{int(limits.cpus * PERIOD_US)} {PERIOD_US}",
                "cpu.weight": str(max(1, min(10_000, limits.weight))),
            }
        return {
            "memory.limit_in_bytes": str(limits.memory_bytes),
            "pids.max": str(limits.pids),
            "cpu.cfs_period_us": str(PERIOD_US),
            "cpu.cfs_quota_us": str(int(limits.cpus * PERIOD_US)),
            "cpu.shares": str(max(2, limits.weight * 1024 // 100)),
        }

    def remove(self, name: str) -> bool:
        """Remove the VMM's cgroups once its processes are gone; False if one still holds some."""
        done = True
        for d in self.dirs(name):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: its last threads are still exiting
                    time.sleep(0.01)
            else:
                done = False
        return done

    def sweep(self) -> None:
        """Remove VMM cgroups left empty by VMMs that died while no worker watched them."""
        for parent in {d.parent for d in self.dirs("x")}:
            if not parent.is_dir():
                continue
            for d in parent.iterdir():
                if d.is_dir() and time.time() - d.stat().st_mtime > STALE_S:
                    with contextlib.suppress(OSError):
                        os.rmdir(d)

    def procs(self, name: str) -> list[int]:
        """The pids in the VMM's cgroup (the first hierarchy's)."""
        dirs = self.dirs(name)
        try:
            return [int(p) for p in (dirs[0] / "cgroup.procs").read_text().split()]
        except (OSError, IndexError):
            return []

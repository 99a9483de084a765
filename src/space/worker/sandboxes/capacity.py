"""Admission on a worker: what its host can really hold, and what its sandboxes really take.

Memory, measured (the default): a live VM counts what its VMM process really takes, its
proportional set size, so the pages the host merges across clones (KSM) and the guest memory
never touched cost nothing; a VM being made, resumed or rebooted, and one not measured yet,
counts its guest RAM plus the VMMs' measured overhead (its worst case right after a restore).
Guest memory (`admit_memory="guest"`): every VM counts its guest RAM plus that overhead, so no
guest can ever run the host short, at the price of density. Either way the host keeps a reserve
for what is not a sandbox (template builds, the gateway, the worker). Suspended sandboxes keep
the room their resume needs; crashed ones the room their reboot needs. vCPUs are overcommitted
by a ratio per host core. Disk: a sandbox's disk and a volume may be larger than what they use
(they are sparse), so the pool admits them up to its real free space times an overcommit
ratio, and refuses (507) past it, before QEMU would stop a guest on a full pool.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from space.worker.sandboxes.errors import NoRoom
from space.worker.sandboxes.usage import pss_bytes

OVERHEAD_FLOOR_MIB = 48  # a QEMU under TCG with a 64 MiB translation cache, measured idle
DISK_OVERCOMMIT = 4.0  # sparse disks: admit up to 4x the pool's real free space
FULL_MIB = 256  # below this much free space the pool takes no new disk at all
# An idle 1-vCPU sandbox under TCG takes 0.6 % of a host core (bench/density.py), so 64 of them
# take about 40 % of one: the default admits 64 vCPUs per core and leaves the rest for work.
VCPU_OVERCOMMIT = 64.0


@dataclass(frozen=True)
class Claim:
    """What one sandbox holds on its worker."""

    vcpus: int
    memory_mib: int
    disk_mib: int = 0  # what its disk may still grow by
    measured_mib: int | None = None  # its live VMM's PSS, when measured


class Capacity:
    def __init__(
        self,
        pool_root: Path,
        *,
        vcpus: int | None,
        memory_mib: int | None,
        reserve_mib: int,
        vcpu_overcommit: float = VCPU_OVERCOMMIT,
        admit_memory: Literal["measured", "guest"] = "measured",
        disk_overcommit: float = DISK_OVERCOMMIT,
    ) -> None:
        self.pool_root = pool_root
        # vCPUs are overcommitted (idle sandboxes barely use theirs); memory is the real bound.
        self.vcpus = vcpus or max(1, int((os.cpu_count() or 1) * vcpu_overcommit))
        self.admit_memory = admit_memory
        self.memory_mib = memory_mib or mem_total_mib() * 3 // 4
        self.reserve_mib = min(reserve_mib, self.memory_mib // 2)
        self.disk_overcommit = disk_overcommit
        # Set while the pool has run out (`fullpool.py`): the room it has is its reserve, there
        # for the guests already running.
        self.pool_full = False
        self.overhead_mib = OVERHEAD_FLOOR_MIB
        self.pss_mib: dict[str, int] = {}  # VM id → its VMM's PSS at the last measurement
        self._reserved: dict[str, Claim] = {}

    # --- what is held -------------------------------------------------------------------------

    def reserve(self, vm_id: str, want: Claim, held: Iterable[Claim]) -> None:
        """Hold room for a VM being made; NoRoom says what is short."""
        used = self.total([*held, *self._reserved.values()])
        if used.vcpus + want.vcpus > self.vcpus:
            raise NoRoom(f"no room for {want.vcpus} vCPUs: {used.vcpus} of {self.vcpus} are in use")
        need = want.memory_mib + self.overhead_mib
        limit = self.memory_mib - self.reserve_mib
        if used.memory_mib + need > limit:
            raise NoRoom(
                f"no room for {want.memory_mib} MiB (+{self.overhead_mib} MiB for its VMM): "
                f"{used.memory_mib} of {limit} MiB are in use"
            )
        self._reserved[vm_id] = want

    def release(self, vm_id: str) -> None:
        self._reserved.pop(vm_id, None)

    def reserved(self) -> set[str]:
        return set(self._reserved)

    def total(self, claims: Iterable[Claim]) -> Claim:
        """vCPUs, MiB (measured, or guest RAM plus VMM overhead) and disk MiB of these claims."""
        cpu = mem = disk = 0
        for c in claims:
            cpu += c.vcpus
            if c.measured_mib is not None and self.admit_memory == "measured":
                mem += c.measured_mib
            else:
                mem += c.memory_mib + self.overhead_mib
            disk += c.disk_mib
        return Claim(cpu, mem, disk)

    def with_reserved(self, held: Iterable[Claim]) -> Claim:
        return self.total([*held, *self._reserved.values()])

    # --- disk ---------------------------------------------------------------------------------

    def free_disk_mib(self) -> int:
        return shutil.disk_usage(self.pool_root).free >> 20

    def disk_limit_mib(self) -> int:
        """How much sparse disks may still grow, in all: the pool's free space times the
        overcommit ratio."""
        return int(self.free_disk_mib() * self.disk_overcommit)

    def check_disk(self, want_mib: int, growth_mib: int) -> None:
        """Refuse a disk or volume of `want_mib` when the pool cannot hold it: `growth_mib` is
        what the disks already here may still grow by (their size less what they use)."""
        if want_mib <= 0:
            return
        free = self.free_disk_mib()
        if free < FULL_MIB or self.pool_full:
            raise NoRoom(f"the worker's pool is full: {free} MiB free")
        limit = int(free * self.disk_overcommit)
        if growth_mib + want_mib > limit:
            raise NoRoom(
                f"no room for {want_mib} MiB of disk: the pool has {free} MiB free and admits "
                f"{self.disk_overcommit:g}x that, and its disks may already grow by "
                f"{growth_mib} MiB"
            )

    def check_snapshot(self, memory_mib: int) -> None:
        """Refuse a snapshot of a guest of `memory_mib` the pool has no room for, before the
        guest is paused for it: a full pool leaves it running, untouched."""
        free = self.free_disk_mib()
        if free < memory_mib + FULL_MIB or self.pool_full:
            raise NoRoom(
                f"no room on the worker's pool for a snapshot of {memory_mib} MiB of memory: "
                f"{free} MiB free"
            )

    # --- measured overhead --------------------------------------------------------------------

    def measure(self, vmms: Iterable[tuple[str, int, int]]) -> None:
        """Learn what each VM takes, and the VMM overhead, from (VM id, VMM pid, guest MiB) of
        the VMs running now. The overhead is what a VMM takes beyond its guest RAM at most (a
        guest that touched all of it), from the VMMs that show it."""
        measured: dict[str, int] = {}
        extra = []
        for vm_id, pid, guest_mib in vmms:
            pss = pss_bytes(pid)
            if pss is not None:
                measured[vm_id] = pss >> 20
                extra.append(max(0, (pss >> 20) - guest_mib))
        self.pss_mib = measured
        if extra:
            self.overhead_mib = max(OVERHEAD_FLOOR_MIB, sum(extra) // len(extra))


def mem_total_mib() -> int:
    return meminfo_mib("MemTotal") or 1024


def meminfo_mib(name: str) -> int | None:
    """A /proc/meminfo figure (MemTotal, MemAvailable, …) in MiB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) // 1024
    return None

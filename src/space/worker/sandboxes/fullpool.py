"""A full pool: guests see their disk full (ENOSPC), rather than QEMU stopping them.

QEMU cannot hand a guest "no space": a write the host refuses either stops the VM (its
default, werror=enospc) or reaches the guest as EIO, which makes ext4 abort its journal. So the
guest's own file system is made full instead. The worker keeps a reserve on the pool; when the
pool runs out (a guest stopped on a write, or less than FULL_MIB/4 free) it gives the reserve
back, continues the stopped guests, and has every running guest's agent allocate the free
blocks of its root file system to one file (`FILL`, unwritten extents: the host stores nothing
for them). Writes that need a new block then fail in the guest with ENOSPC, while what is
already written is read and overwritten from the reserve. Once the pool has room again, the
files are removed and the reserve is taken again.

What this cannot do: a guest overwriting its own blocks still needs new room on a
copy-on-write pool, and that comes from the reserve; once the reserve is gone too, QEMU stops
such a guest until there is room (the watch continues it then), as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from space.worker.agent_client import AgentError
from space.worker.machine import Machine
from space.worker.sandboxes.capacity import FULL_MIB
from space.worker.sandboxes.records import SandboxVM
from space.worker.vmm.base import VMMError, VMState

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager

log = logging.getLogger(__name__)

RESERVE_FILE = "pool-reserve"
MARKER_FILE = "pool-full"
RESERVE_MIB = 384
FILL = "/.space-pool-full"
AGENT_TIMEOUT_S = 10.0
# Allocate the root file system's free blocks to FILL, largest pieces first, down to 1 MiB.
FILL_SCRIPT = f"""
import os
fd = os.open({FILL!r}, os.O_WRONLY | os.O_CREAT, 0o600)
size, piece = os.fstat(fd).st_size, 256 << 20
while piece >= 1 << 20:
    try:
        os.posix_fallocate(fd, size, piece)
        size += piece
    except OSError:
        piece //= 2
os.close(fd)
"""


class FullPool:
    """The worker's answer to its pool running out: see the module's docstring."""

    def __init__(self, manager: VMManager) -> None:
        self.manager = manager
        self.reserve = manager.root / RESERVE_FILE
        self.marker = manager.root / MARKER_FILE  # guests may hold FILL: a restart removes it
        self.full = False
        self.filled: set[str] = set()  # the guests whose FILL is in place

    def _free_mib(self) -> int:
        return self.manager.capacity.free_disk_mib()

    async def take_reserve(self) -> None:
        """Hold RESERVE_MIB of the pool, if it has that and FULL_MIB besides."""
        if self.reserve.exists() or self._free_mib() < RESERVE_MIB + 2 * FULL_MIB:
            return
        await asyncio.to_thread(_allocate, self.reserve, RESERVE_MIB << 20)

    async def start(self, vms: list[SandboxVM]) -> None:
        """At the worker's start: give back what an earlier process that found the pool full
        may have filled (its marker says so; which guests, it did not say), take the reserve."""
        if self.marker.exists():
            self.filled = {sb.id for sb in vms}
            await self._unfill(vms)
            if not self.filled:
                self.marker.unlink(missing_ok=True)
        await self.take_reserve()

    async def check(self, vms: list[SandboxVM]) -> None:
        if not self.full and self.filled:  # left from the last time the pool ran out
            await self._unfill(vms)
        stopped = any(sb.machine is not None and sb.machine.io_error for sb in vms)
        if not self.full and (stopped or self._free_mib() < FULL_MIB // 4):
            self.full = self.manager.capacity.pool_full = True
            self.marker.touch()
            log.warning("the pool is full: guests' disks are made full, the reserve given back")
            self.reserve.unlink(missing_ok=True)
        if self.full:
            # btrfs shows freed room only once it commits (by itself every 30 s).
            await asyncio.to_thread(os.sync)
            live = {sb.id for sb in vms}
            self.filled &= live
            await asyncio.gather(*(self._fill(sb) for sb in vms if sb.id not in self.filled))
            if self._free_mib() >= RESERVE_MIB + 2 * FULL_MIB:
                await self._room_again(vms)

    async def _fill(self, sb: SandboxVM) -> None:
        machine = sb.machine
        if machine is None or sb.condition != "live":
            return
        if machine.io_error is not None:
            if self._free_mib() < FULL_MIB // 4:
                return  # nothing to go on with: the watch continues it once there is room
            with contextlib.suppress(VMMError, TimeoutError):
                await machine.vm.continue_after_io_error()
                machine.io_error = None
        if machine.io_error is not None or _running(sb) is None:
            return  # paused guests are filled once they run
        try:
            r = await machine.agent.run(["python3", "-c", FILL_SCRIPT], timeout=AGENT_TIMEOUT_S)
        except (AgentError, TimeoutError, OSError) as e:
            log.warning("VM %s: could not make its disk full: %s", sb.id, e)
            return
        if r.exit_code == 0:
            self.filled.add(sb.id)
            log.info("VM %s: its disk is full while the pool is", sb.id)

    async def _room_again(self, vms: list[SandboxVM]) -> None:
        log.info("the pool has room again: guests' disks are given back their free space")
        # The pool takes work again whatever the guests do: one that does not answer now gets
        # its room back at a later pass.
        self.full = self.manager.capacity.pool_full = False
        await self._unfill(vms)
        await self.take_reserve()

    async def _unfill(self, vms: list[SandboxVM]) -> None:
        async def one(sb: SandboxVM) -> None:
            machine = _running(sb)
            if machine is None:
                return
            try:
                await machine.agent.run(["rm", "-f", FILL], timeout=AGENT_TIMEOUT_S)
            except (AgentError, TimeoutError, OSError) as e:
                log.warning("VM %s: could not give its disk back its room: %s", sb.id, e)
                return
            self.filled.discard(sb.id)

        self.filled &= {sb.id for sb in vms}
        await asyncio.gather(*(one(sb) for sb in vms if sb.id in self.filled))
        if not self.filled and not self.full:
            self.marker.unlink(missing_ok=True)


def _running(sb: SandboxVM) -> Machine | None:
    """The sandbox's machine, if it is there and its guest runs (its agent can answer)."""
    machine = sb.machine
    if machine is None or sb.condition != "live" or machine.status().state != VMState.RUNNING:
        return None
    return machine


def _allocate(path: Path, size: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        return
    os.close(fd)
    tmp.replace(path)

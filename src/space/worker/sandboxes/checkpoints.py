"""Checkpoints of a running sandbox, and rolling it back to one in place.

A checkpoint is a snapshot like a suspend's (memory, devices, a reflinked copy of the disk),
taken while the sandbox goes on running: its memory is copied live (`VM.snapshot_live`), and
the guest stops only for the pages it dirtied last and the clone of its disk. It is written
into a hidden directory, flushed, and renamed to `checkpoints/<sandbox>/<checkpoint>`, so a
crash never leaves half of one.

A rollback stops the sandbox's VMM and restores the checkpoint under the sandbox's own id and
hostname (a fresh agent token, the clock and a reseeded RNG, as every restore gets). The old run
directory is put aside first and put back if the restore fails (the sandbox is then crashed,
with its disk, and boots again from it), so a failed rollback loses nothing.

Volumes are not in checkpoints: they stay as they are. A sandbox with volumes cannot be rolled
back (its guest would find the volume's file system as it was cached at the checkpoint, on a
disk that has moved on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from space.gateway.policy import Policy
from space.worker.machine import Machine
from space.worker.sandboxes import recovery
from space.worker.sandboxes.capacity import Claim
from space.worker.sandboxes.errors import InvalidArgument, VMNotFound, WrongState
from space.worker.sandboxes.records import SANDBOX_FILE, SandboxVM, fsync_tree, rename_durable
from space.worker.vmm.base import SnapshotInfo, VMMError, VMState

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager

log = logging.getLogger(__name__)

ASIDE = ".rollback-"


@dataclass(frozen=True)
class Taken:
    """A checkpoint on disk: where, its bytes on the pool, and how long the guest was paused."""

    path: Path
    size_bytes: int
    paused_ms: float


def directory(manager: VMManager, vm_id: str) -> Path:
    return manager.layout.checkpoints / vm_id


async def take(manager: VMManager, sb: SandboxVM, checkpoint_id: str) -> Taken:
    """Checkpoint a running sandbox; the same checkpoint again answers the one on disk."""
    final = directory(manager, sb.id) / checkpoint_id
    if final.exists():
        return Taken(final, await _size(final), 0.0)
    machine = sb.live_machine("checkpoint")
    if sb.state != "running":
        raise WrongState(f"cannot checkpoint VM {sb.id}: it is {sb.state}", sb.state)
    manager.capacity.check_snapshot(sb.spec.memory_mib)
    final.parent.mkdir(exist_ok=True)
    tmp = final.parent / f".{checkpoint_id}.{uuid.uuid4().hex[:8]}"
    try:
        _, paused_ms = await snapshot_running(machine, tmp)
        sb.save(tmp)
        await asyncio.to_thread(fsync_tree, tmp)
        rename_durable(tmp, final)
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise
    log.info("VM %s: checkpoint %s taken, guest paused %.0f ms", sb.id, checkpoint_id, paused_ms)
    return Taken(final, await _size(final), paused_ms)


async def snapshot_running(machine: Machine, dest: Path) -> tuple[SnapshotInfo, float]:
    """Snapshot a running VM into `dest`, live (its memory copied while it runs), and let it
    run again; how long it was stopped (ms). Its file systems are synced first."""
    await machine.quiesce()
    try:
        snap = await machine.vm.snapshot_live(dest)
        returned = time.perf_counter()
    finally:
        if machine.status().state == VMState.PAUSED:
            await machine.resume()
    return snap, (snap.downtime_s + time.perf_counter() - returned) * 1000


async def remove(manager: VMManager, vm_id: str, checkpoint_id: str) -> bool:
    path = directory(manager, vm_id) / checkpoint_id
    if not path.exists():
        return False
    aside = path.parent / f".{checkpoint_id}.deleted"
    rename_durable(path, aside)  # gone at once for every reader, then removed at leisure
    await asyncio.to_thread(shutil.rmtree, aside, True)
    return True


async def remove_all(manager: VMManager, vm_id: str) -> None:
    await asyncio.to_thread(shutil.rmtree, directory(manager, vm_id), True)


def load(manager: VMManager, vm_id: str, checkpoint_id: str) -> SnapshotInfo:
    path = directory(manager, vm_id) / checkpoint_id
    try:
        return SnapshotInfo.load(path)
    except VMMError:
        raise VMNotFound(f"VM {vm_id} has no checkpoint {checkpoint_id!r} here") from None


async def rollback(manager: VMManager, sb: SandboxVM, checkpoint_id: str) -> SandboxVM:
    """The sandbox as it was at the checkpoint: its memory (so its processes) and its disk."""
    snap = load(manager, sb.id, checkpoint_id)
    if sb.spec.volumes:
        raise InvalidArgument(
            f"VM {sb.id} has volumes: a sandbox with volumes cannot be rolled back"
        )
    machine = sb.live_machine("roll back")
    run_dir = machine.run_dir
    aside = run_dir.parent / f"{ASIDE}{sb.id}.{uuid.uuid4().hex[:8]}"
    sb.replacing = True
    try:
        restored = await _replace(manager, sb, machine, snap, aside)
    finally:
        sb.replacing = False
    sb.machine, sb.condition, sb.why = restored, "live", None
    sb.save(run_dir)
    await asyncio.to_thread(shutil.rmtree, aside, True)
    return sb


async def _replace(
    manager: VMManager, sb: SandboxVM, machine: Machine, snap: SnapshotInfo, aside: Path
) -> Machine:
    run_dir = machine.run_dir
    policy = manager.policy(sb.id) or Policy()
    await machine.agent.close()
    await machine.vm.close()  # the VMM and its sockets; its disk stays until the restore took
    await manager.detach(sb.id, keep_policy=True)
    run_dir.rename(aside)
    manager.capacity.reserve(sb.id, Claim(sb.spec.vcpus, sb.spec.memory_mib), manager.held(sb.id))
    try:
        async with manager.network(sb.id, policy) as tap_fd:
            return await Machine.restore(
                manager.driver, manager.pool, snap, vm_id=sb.id, hostname=sb.spec.hostname,
                vms_dir=manager.layout.vms, tap_fd=tap_fd,
            )  # fmt: skip
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir, ignore_errors=True)
            aside.rename(run_dir)
        sb.machine, sb.condition, sb.why = None, "crashed", "a rollback failed"
        raise
    finally:
        manager.capacity.release(sb.id)


async def clean(manager: VMManager) -> None:
    """Half-written checkpoints; and run directories a rollback put aside before a crash: put
    back if the restore never made the new one (the sandbox boots again from that disk)."""
    for tmp in manager.layout.checkpoints.glob("*/.*"):
        shutil.rmtree(tmp, ignore_errors=True)
    for aside in manager.layout.vms.glob(f"{ASIDE}*"):
        run_dir = aside.parent / aside.name[len(ASIDE) :].rsplit(".", 1)[0]
        if (run_dir / SANDBOX_FILE).exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            await recovery.kill_leftover(run_dir)  # a restore that had not finished
            rename_durable(aside, run_dir)


async def _size(path: Path) -> int:
    return await asyncio.to_thread(lambda: SnapshotInfo.load(path).size_bytes())

"""Suspend a sandbox to disk and resume it, durably and atomically.

Suspend: the VM is paused and saved (memory, devices, a reflinked copy of its disk, its
sandbox.json) into `suspended/.<id>.<tag>`, which is flushed to disk and then renamed to
`suspended/<id>`; only then does the VMM stop and its run directory go. Until the rename the
running VM is the sandbox; after it, the snapshot is (a worker that starts and finds both
kills the VM, which has been paused since the snapshot).

Resume: a VMM loads the snapshot into a new run directory with its vCPUs stopped; the snapshot
is renamed to `suspended/.consumed-<id>.<tag>` before the guest runs, so from then on the VM's
own disk is the sandbox (the consumed copy is removed afterwards, or at the next start). If the
resume fails before the guest ran, the snapshot is renamed back: still suspended, nothing lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from space import crashpoints
from space.gateway.policy import Policy
from space.worker.machine import Machine
from space.worker.sandboxes.capacity import Claim
from space.worker.sandboxes.errors import WrongState
from space.worker.sandboxes.records import SandboxVM, fsync_tree, rename_durable
from space.worker.templates.errors import RegistryError
from space.worker.vmm.base import SnapshotInfo, VMMError, VMState

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager

log = logging.getLogger(__name__)

CONSUMED = ".consumed-"
UNRESTORABLE = ".unrestorable-"


async def suspend(manager: VMManager, sb: SandboxVM) -> SandboxVM:
    machine = sb.live_machine("suspend")
    manager.capacity.check_snapshot(sb.spec.memory_mib)
    # Stopped by an I/O error counts as running: if the snapshot fails, the guest goes on (and
    # QEMU stops it again if the pool is still full).
    was_running = sb.state == "running" or machine.io_error is not None
    suspended = manager.layout.suspended
    tmp = suspended / f".{sb.id}.{uuid.uuid4().hex[:8]}"
    try:
        await machine.snapshot(tmp)
        sb.save(tmp)
        await asyncio.to_thread(fsync_tree, tmp)
        crashpoints.reached("suspend.after-snapshot")
        rename_durable(tmp, suspended / sb.id)
        crashpoints.reached("suspend.after-publish")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if was_running and machine.status().state == VMState.PAUSED:
            with contextlib.suppress(VMMError, TimeoutError):
                await machine.resume()
        raise
    await machine.close()
    crashpoints.reached("suspend.after-stop")
    sb.machine, sb.condition = None, "suspended"
    # Its egress policy (secret values with it) leaves the worker: the control plane sends it
    # again before the resume, so a worker holds secrets only of sandboxes that run there.
    await manager.detach(sb.id)
    return sb


def unrestorable(snap_dir: Path) -> str | None:
    """Why the snapshot in `snap_dir` cannot be restored, or None if it looks whole: its
    manifest reads and every file it names is there."""
    try:
        snap = SnapshotInfo.load(snap_dir)
    except (VMMError, OSError, ValueError, KeyError, TypeError) as e:
        return str(e) or type(e).__name__
    for role in ("state", "disk"):
        if role not in snap.files:
            return f"its manifest names no {role} file"
    missing = [name for name in snap.files.values() if not (snap_dir / name).is_file()]
    return f"{', '.join(missing)} missing" if missing else None


def set_aside(snap_dir: Path) -> Path:
    """Move a snapshot out of the way, kept for an operator: `suspended/.unrestorable-…`."""
    aside = snap_dir.parent / f"{UNRESTORABLE}{snap_dir.name}.{uuid.uuid4().hex[:8]}"
    rename_durable(snap_dir, aside)
    return aside


async def resume(manager: VMManager, sb: SandboxVM) -> SandboxVM:
    snap_dir = manager.layout.suspended / sb.id
    try:
        snap = SnapshotInfo.load(snap_dir)
    except VMMError as e:
        raise WrongState(f"VM {sb.id} is suspended but its snapshot is unusable: {e}",
                         "suspended") from None  # fmt: skip
    consumed = manager.layout.suspended / f"{CONSUMED}{sb.id}.{uuid.uuid4().hex[:8]}"

    async def retire_snapshot(run_dir: Path) -> None:
        crashpoints.reached("resume.after-restore")
        sb.save(run_dir)
        rename_durable(snap_dir, consumed)
        crashpoints.reached("resume.after-consume")

    # A suspended sandbox already counts for the room its resume needs: reserve it apart from
    # that, so the check is against everything else.
    manager.capacity.reserve(
        sb.id, Claim(sb.spec.vcpus, sb.spec.memory_mib), manager.held(but=sb.id)
    )
    try:
        policy = manager.policy(sb.id)
        # Its empty slots are this worker's file: the snapshot may come from another worker.
        drives = tuple(
            replace(d, path=manager.volumes.empty_slot) if d.placeholder else d
            for d in snap.config.drives
        )
        async with manager.network(sb.id, policy or Policy()) as tap_fd:
            try:
                machine = await Machine.restore(
                    manager.driver, manager.pool, snap, vm_id=sb.id,
                    hostname=sb.spec.hostname, vms_dir=manager.layout.vms, tap_fd=tap_fd,
                    drives=drives, before_start=retire_snapshot,
                )  # fmt: skip
            except BaseException:
                if consumed.exists() and not snap_dir.exists():
                    rename_durable(consumed, snap_dir)  # the guest never ran: still suspended
                raise
        crashpoints.reached("resume.after-cont")
        if policy is None and manager.egress is not None:
            manager.mark_stale(sb.id)  # suspended under an earlier worker process
    finally:
        manager.capacity.release(sb.id)
    sb.machine, sb.condition = machine, "live"
    if sb.artifact is not None and manager.artifacts is not None:
        # Running again: the pushed snapshot is of no more use to anyone.
        with contextlib.suppress(RegistryError, OSError):
            await manager.artifacts.delete(sb.artifact)
        sb.artifact = None
    await asyncio.to_thread(shutil.rmtree, consumed, True)
    return sb


def clean(suspended: Path) -> None:
    """Half-written snapshots and consumed ones a previous process left (never one set aside
    for an operator)."""
    for tmp in suspended.glob(".*"):
        if not tmp.name.startswith(UNRESTORABLE):
            shutil.rmtree(tmp, ignore_errors=True)

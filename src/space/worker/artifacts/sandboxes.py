"""Suspended sandboxes through the registry: a snapshot (memory, devices, its disk, its
sandbox.json) pushed once it is taken, and pulled by another worker that is to resume it, so a
sandbox outlives the host it was suspended on.

A sandbox with volumes stays where it is: its volumes' images are that host's.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from typing import TYPE_CHECKING

from space.worker.artifacts.trust import foreign_snapshot_problem
from space.worker.sandboxes.errors import VMNotFound, WrongState
from space.worker.sandboxes.records import UNREADABLE, SandboxVM
from space.worker.templates.errors import ImageError, RegistryError
from space.worker.vmm.base import SnapshotInfo, VMMError

if TYPE_CHECKING:
    from space.worker.sandboxes import VMManager

log = logging.getLogger(__name__)
KIND = "sandbox"
PUSH_S = 90.0  # within the controller's deadline for a suspend, which holds the sandbox's lock


async def push(manager: VMManager, sb: SandboxVM) -> str | None:
    """The suspended sandbox's snapshot in the registry, a new tag each time; None where it
    cannot move (no registry, volumes) or the push failed (it stays suspended here)."""
    if manager.artifacts is None or sb.spec.volumes:
        return None
    try:
        pushed = await asyncio.wait_for(manager.artifacts.push(
            KIND, sb.id, uuid.uuid4().hex, manager.layout.suspended / sb.id, {"id": sb.id},
            log.info,
        ), PUSH_S)  # fmt: skip
    except (RegistryError, OSError, TimeoutError) as e:
        log.warning("suspended sandbox %s not pushed (it can resume only here): %s", sb.id, e)
        return None
    return pushed.reference


async def adopt(manager: VMManager, vm_id: str, artifact: str) -> SandboxVM:
    """A sandbox suspended on another worker, pulled here, suspended still; the same again if
    this worker has adopted that snapshot already. A copy this worker kept from before the
    sandbox last left it is stale: it is removed, and the snapshot pulled."""
    if manager.artifacts is None:
        raise WrongState("this worker has no registry to pull a sandbox from", "missing")
    try:
        have: SandboxVM | None = manager.get(vm_id)
    except VMNotFound:
        have = None
    if have is not None and have.condition == "suspended" and have.artifact == artifact:
        return have
    if have is not None and have.condition != "suspended":
        raise WrongState(f"VM {vm_id} is here already, {have.state}", have.state)
    await manager.delete(vm_id)  # a stale copy, if any
    async with manager.locks.hold(vm_id):
        dest = manager.layout.suspended / vm_id
        await manager.artifacts.pull(artifact, KIND, vm_id, dest, log.info)
        try:
            sb = SandboxVM.load(vm_id, dest, None)
            why = foreign_snapshot_problem(manager.templates["base"], SnapshotInfo.load(dest), sb)
        except (*UNREADABLE, VMMError) as e:
            why = str(e)
        if why is not None:
            await asyncio.to_thread(shutil.rmtree, dest, True)
            raise ImageError(f"{artifact} is no snapshot this worker can resume: {why}")
        sb.condition, sb.artifact = "suspended", artifact
        manager.adopt_record(sb)
        log.info("sandbox %s adopted from %s", vm_id, artifact)
    return sb

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

from space.gateway.policy import Policy
from space.worker.sandboxes.errors import VMNotFound, WrongState
from space.worker.sandboxes.records import UNREADABLE, SandboxVM
from space.worker.templates.errors import ImageError, RegistryError

if TYPE_CHECKING:
    from space.worker.sandboxes import VMManager

log = logging.getLogger(__name__)
KIND = "sandbox"


async def push(manager: VMManager, sb: SandboxVM) -> str | None:
    """The suspended sandbox's snapshot in the registry, a new tag each time; None where it
    cannot move (no registry, volumes) or the push failed (it stays suspended here)."""
    if manager.artifacts is None or sb.spec.volumes:
        return None
    try:
        pushed = await manager.artifacts.push(
            KIND, sb.id, uuid.uuid4().hex, manager.layout.suspended / sb.id, {"id": sb.id},
            lambda line: log.info("%s", line),
        )  # fmt: skip
    except (RegistryError, OSError) as e:
        log.warning("suspended sandbox %s not pushed (it can resume only here): %s", sb.id, e)
        return None
    return pushed.reference


async def adopt(manager: VMManager, vm_id: str, artifact: str, policy: Policy) -> SandboxVM:
    """A sandbox suspended on another worker, pulled here, suspended still; the same again if
    this worker has it already."""
    if manager.artifacts is None:
        raise WrongState("this worker has no registry to pull a sandbox from", "missing")
    async with manager.locks.hold(vm_id):
        try:
            have: SandboxVM | None = manager.get(vm_id)
        except VMNotFound:
            have = None
        if have is not None and have.condition != "suspended":
            raise WrongState(f"VM {vm_id} is here already, {have.state}", have.state)
        if have is None:
            dest = manager.layout.suspended / vm_id
            if not dest.exists():
                await manager.artifacts.pull(artifact, KIND, dest, lambda line: log.info(line))
            try:
                have = SandboxVM.load(vm_id, dest, None)
            except UNREADABLE as e:
                await asyncio.to_thread(shutil.rmtree, dest, True)
                raise ImageError(f"{artifact} holds no sandbox {vm_id}: {e}") from None
            have.condition = "suspended"
            manager.adopt_record(have)
            log.info("sandbox %s adopted from %s", vm_id, artifact)
    await manager.set_policy(vm_id, policy)  # in force once it runs
    return have

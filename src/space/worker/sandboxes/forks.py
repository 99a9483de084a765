"""Forks: running children made from a sandbox's state while it runs on, or from a checkpoint.

The parent is snapshotted as a checkpoint is (a short pause), into a hidden directory under its
checkpoints. For more than one child that stream is loaded once into a VM whose memory is a
file, and saved again (`machine.remap`): the children map that file, reading the pages they
touch and sharing those none of them writes, instead of each copying the whole stream.

Every child is a restore of that snapshot under its own id, with a network of its own (its own
namespace, tap and egress policy), a hostname, a fresh agent token, our clock, a reseeded RNG
and the caller's environment, as a restore of a base snapshot gets. The snapshots are removed
once the children run. If any child fails, every child made is deleted again before the call
answers, so a failed fork leaves nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from space.gateway.policy import Policy
from space.worker.machine import Machine
from space.worker.sandboxes import checkpoints
from space.worker.sandboxes.capacity import Claim
from space.worker.sandboxes.errors import InvalidArgument, WrongState
from space.worker.sandboxes.records import SandboxVM
from space.worker.vmm.base import SnapshotInfo

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Child:
    id: str
    hostname: str
    env: Mapping[str, str]
    policy: Policy | None = None


async def fork(
    manager: VMManager, parent: SandboxVM, children: Sequence[Child], checkpoint_id: str | None
) -> tuple[list[SandboxVM], float]:
    """The running children, and how long the parent was paused (ms; 0 from a checkpoint)."""
    if parent.spec.volumes:
        raise InvalidArgument(
            f"VM {parent.id} has volumes: a volume has one writer, so it cannot be forked"
        )
    if len({c.id for c in children}) != len(children):
        raise InvalidArgument("the children's ids must differ")
    if taken := sorted(c.id for c in children if manager.has(c.id)):
        raise WrongState(f"VMs {', '.join(taken)} exist already on this worker", "running")
    manager.capacity.check_snapshot(parent.spec.memory_mib)
    tmp = None
    if checkpoint_id is not None:
        snap, paused_ms = checkpoints.load(manager, parent.id, checkpoint_id), 0.0
    else:
        machine = parent.live_machine("fork")
        if parent.state != "running":
            raise WrongState(f"cannot fork VM {parent.id}: it is {parent.state}", parent.state)
        tmp = checkpoints.directory(manager, parent.id) / f".fork-{uuid.uuid4().hex[:8]}"
        tmp.parent.mkdir(exist_ok=True)
        try:
            snap, paused_ms = await checkpoints.snapshot_running(machine, tmp)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, tmp, True)
            raise
    mapped = None
    try:
        if len(children) > 1 and _mappable(manager, snap):
            # The children map one file of its memory, rather than each copy the whole stream.
            tag = uuid.uuid4().hex[:8]
            mapped = checkpoints.directory(manager, parent.id) / f".fork-{tag}"
            snap = await manager.snapshots.remap(snap, mapped, f"fork-{parent.id}-{tag}")
        made = await asyncio.gather(
            *(_child(manager, parent, snap, c) for c in children), return_exceptions=True
        )
    finally:
        for path in (tmp, mapped):
            if path is not None:
                await asyncio.to_thread(shutil.rmtree, path, True)
    failed = [r for r in made if isinstance(r, BaseException)]
    if failed:
        for r in made:
            if isinstance(r, SandboxVM):
                with contextlib.suppress(Exception):
                    await manager.delete(r.id)
        log.warning("fork of %s failed; its %d children made were deleted: %s", parent.id,
                    len(made) - len(failed), failed[0])  # fmt: skip
        raise failed[0]
    return [r for r in made if isinstance(r, SandboxVM)], paused_ms


def _mappable(manager: VMManager, snap: SnapshotInfo) -> bool:
    """Whether the snapshot is a stream that can become a memory file (a balloon's freed pages
    would be punched out of a file, so RAM with a balloon stays anonymous)."""
    return (manager.driver.mapped_memory and "memory" not in snap.files
            and not snap.config.free_page_reporting)  # fmt: skip


async def _child(
    manager: VMManager, parent: SandboxVM, snap: SnapshotInfo, child: Child
) -> SandboxVM:
    async with manager.locks.hold(child.id):
        if manager.has(child.id):
            raise WrongState(f"a VM {child.id} exists already on this worker", "running")
        started = time.perf_counter()
        spec = replace(parent.spec, env=dict(child.env), hostname=child.hostname, volumes=())
        manager.capacity.reserve(child.id, Claim(spec.vcpus, spec.memory_mib), manager.held())
        try:
            async with manager.network(child.id, child.policy or Policy()) as tap_fd:
                machine = await Machine.restore(
                    manager.driver, manager.pool, snap, vm_id=child.id,
                    hostname=child.hostname, vms_dir=manager.layout.vms,
                    drives=await manager.volumes.drives(()), tap_fd=tap_fd,
                )  # fmt: skip
            sb = SandboxVM(child.id, spec, machine, "fork", (time.perf_counter() - started) * 1000)
            try:
                sb.save(machine.run_dir)
            except BaseException:
                await machine.close()
                await manager.detach(child.id)
                raise
        finally:
            manager.capacity.release(child.id)
        manager.adopt_record(sb)
        return sb

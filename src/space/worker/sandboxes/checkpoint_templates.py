"""Templates made of checkpoints: a checkpoint's disk becomes the template's file system, and
its memory the base snapshot of its shape, so sandboxes of it start with its processes running.

The template is staged whole in a hidden directory (clones of the checkpoint's files, which it
keeps: it outlives the checkpoint and its sandbox), its base snapshot is made and restored once
to see that its guest answers, and only then is the template renamed into place and used: a
build that fails or dies leaves the last good build of the name as the one in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from space import crashpoints
from space.gateway.policy import Policy
from space.worker.machine import BootImages, Machine
from space.worker.sandboxes import checkpoints, guest
from space.worker.sandboxes.errors import InvalidArgument
from space.worker.sandboxes.records import SandboxSpec, SandboxVM, rename_durable
from space.worker.templates import TemplateRecord, stage_template
from space.worker.templates.builder import TEMPLATES_DIR
from space.worker.templates.record import SNAPSHOT_DIR
from space.worker.vmm.base import SnapshotInfo

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager


async def make(
    manager: VMManager, vm_id: str, checkpoint_id: str, name: str, log: Callable[[str], None]
) -> TemplateRecord:
    """Template `name` of a checkpoint of VM `vm_id`, in use once this returns."""
    started = time.monotonic()
    async with manager.locks.hold(vm_id):  # the checkpoint stays while it is cloned
        snap = checkpoints.load(manager, vm_id, checkpoint_id)
        spec = SandboxVM.load(vm_id, snap.path, None).spec
        if spec.volumes:
            raise InvalidArgument(
                f"checkpoint {checkpoint_id} is of a sandbox with volumes: its guest has them "
                "mounted, and a template's sandboxes would not"
            )
        record = _record(manager, vm_id, checkpoint_id, name, snap, spec)
        log(f"cloning checkpoint {checkpoint_id} of {vm_id} ({spec.vcpus} vCPUs, "
            f"{spec.memory_mib} MiB)")  # fmt: skip
        disk = snap.path / snap.files["disk"]
        staged = await asyncio.to_thread(stage_template, record, disk, snap)
    made = manager.snapshots.staging(name) if manager.options.base_snapshots else None
    crashpoints.reached("template.after-stage")
    try:
        if made is not None:
            log("loading its memory into a file its sandboxes map")
            source = SnapshotInfo.load(staged / SNAPSHOT_DIR)
            base = await manager.snapshots.remap(source, made, f"tpl-{name}-{made.name[-8:]}")
            log("restoring it once: its guest must answer")
            await _answers(manager, base, name)
            kernel = manager.templates["base"]
            images = BootImages(kernel.kernel, kernel.initrd, record.rootfs)
            await manager.snapshots.put(name, spec.vcpus, spec.memory_mib, images, made)
            crashpoints.reached("template.after-base")
        rename_durable(staged, record.path)
    except BaseException:
        for path in (staged, made):
            if path is not None:
                await asyncio.to_thread(shutil.rmtree, path, True)
        with contextlib.suppress(OSError):
            record.path.parent.rmdir()  # only if no build of the name is left
        raise
    manager.refresh_templates()
    log(f"template {name}: made in {time.monotonic() - started:.1f} s")
    return record


def _record(
    manager: VMManager, vm_id: str, checkpoint_id: str, name: str, snap: SnapshotInfo,
    spec: SandboxSpec,
) -> TemplateRecord:  # fmt: skip
    # Every build has a digest of its own, so the newest is always the one in use.
    digest = uuid.uuid4().hex[:16]
    source = hashlib.sha256(f"{vm_id}/{checkpoint_id}".encode()).hexdigest()
    # How the sandbox ran processes (not its own env: every create gives its own), and the
    # command and service of the template it was made of, should it ever boot from its disk.
    made_of = manager.records.get(spec.template)
    return TemplateRecord(
        name=name, digest=digest, path=manager.pool.root / TEMPLATES_DIR / name / digest,
        source=f"checkpoint {checkpoint_id} of sandbox {vm_id} (template {spec.template})",
        source_digest=f"sha256:{source}",
        size_bytes=(snap.path / snap.files["disk"]).stat().st_size,
        env={k: v for k, v in spec.template_env.items() if k not in guest.CA_ENV},
        workdir=spec.workdir, user=spec.user,
        entrypoint=list(made_of.entrypoint) if made_of else [],
        cmd=list(made_of.cmd) if made_of else [],
        start=made_of.start if made_of else None, ready=made_of.ready if made_of else None,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        snapshot=SNAPSHOT_DIR, vcpus=spec.vcpus, memory_mib=spec.memory_mib,
    )  # fmt: skip


async def _answers(manager: VMManager, base: SnapshotInfo, name: str) -> None:
    """Restore one VM of the new base snapshot, as a create would, and let it go again."""
    vm_id = f"tpl-{name}-check-{uuid.uuid4().hex[:6]}"
    async with manager.build_network(vm_id, Policy()) as tap_fd:
        machine = await Machine.restore(
            manager.driver, manager.pool, base, vm_id=vm_id, vms_dir=manager.layout.building,
            drives=await manager.volumes.drives(()), tap_fd=tap_fd,
        )  # fmt: skip
        await machine.close()

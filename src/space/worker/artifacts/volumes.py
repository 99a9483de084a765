"""Volumes through the registry: a detached volume's image pushed, and pulled by the worker of
its next sandbox unless that worker's copy is the very one pushed, so a volume follows its
sandboxes between hosts (one writer still: the control plane moves only a volume no sandbox
has).

Next to each image, `<id>.artifact` names the push it is a copy of. A pulled image replaces a
stale copy by rename, so a sandbox never sees half of one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from space.worker.api.models import VolumeSpec
from space.worker.sandboxes.errors import InvalidArgument, VolumeInUse
from space.worker.storage.reflink import clone_file
from space.worker.templates.errors import ImageError

if TYPE_CHECKING:
    from space.worker.sandboxes import VMManager

log = logging.getLogger(__name__)
KIND = "volume"
IMAGE = "volume.img"


def _marker(manager: VMManager, volume_id: str) -> Path:
    return manager.volumes.dir / f"{volume_id}.artifact"


def _users(manager: VMManager, volume_id: str) -> list[str]:
    return sorted(sb.id for sb in manager.vms() if any(v.id == volume_id for v in sb.spec.volumes))


async def push(manager: VMManager, volume_id: str) -> str:
    """The volume's image as it is now, in the registry; refused while a sandbox here has it."""
    if manager.artifacts is None:
        raise InvalidArgument("this worker has no registry to push to")
    image = manager.volumes.image(volume_id)
    if users := _users(manager, volume_id):
        raise VolumeInUse(f"volume {volume_id} is attached to {', '.join(users)}")
    if not image.exists():
        raise InvalidArgument(f"this worker has no image of volume {volume_id}")
    # A reflink of it at this instant is what goes: a sandbox attaching meanwhile writes its own.
    stage = Path(tempfile.mkdtemp(prefix=".push-", dir=manager.volumes.dir))
    try:
        await asyncio.to_thread(clone_file, image, stage / IMAGE)
        pushed = await manager.artifacts.push(
            KIND, volume_id, uuid.uuid4().hex, stage, {"id": volume_id}, log.info
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, stage, True)
    _marker(manager, volume_id).write_text(pushed.reference)
    return pushed.reference


async def ensure(manager: VMManager, spec: VolumeSpec) -> None:
    """This worker's copy of the volume is the one `spec.artifact` names: pulled if not."""
    if spec.artifact is None or manager.artifacts is None:
        return
    marker = _marker(manager, spec.id)
    if marker.exists() and marker.read_text() == spec.artifact:
        return
    if users := _users(manager, spec.id):
        raise VolumeInUse(f"volume {spec.id} is attached to {', '.join(users)} here")
    dest = manager.volumes.dir / f".pull-{spec.id}-{uuid.uuid4().hex[:8]}"
    try:
        plan = await manager.artifacts.pull(spec.artifact, KIND, spec.id, dest, log.info)
        if [f.path for f in plan.files] != [IMAGE] or plan.files[0].size > spec.size_mib << 20:
            raise ImageError(f"{spec.artifact} is no image of volume {spec.id}")
        marker.unlink(missing_ok=True)  # no copy is that push until the image is in place
        os.replace(dest / IMAGE, manager.volumes.image(spec.id))
        marker.write_text(spec.artifact)
    finally:
        await asyncio.to_thread(shutil.rmtree, dest, True)

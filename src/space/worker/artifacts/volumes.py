"""Volumes through the registry: a detached volume's image pushed from its worker, and pulled
by another worker when the control plane moves the volume there (its own worker lost or being
drained), so a volume outlives the host it was made on. One writer still: only a volume no
sandbox has is pushed or moved, and the control plane records either only if nothing attached
it meanwhile.

Next to each image, `<id>.artifact` names the push it is a copy of (removed as soon as a
sandbox may write it). A pulled image is written durably and renamed into place.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from space.worker.api.models import VOLUME_ID
from space.worker.sandboxes.errors import InvalidArgument, VolumeInUse
from space.worker.sandboxes.records import fsync_tree, rename_durable, write_durable
from space.worker.storage.reflink import clone_file
from space.worker.templates.errors import ImageError

if TYPE_CHECKING:
    from space.worker.sandboxes import VMManager

log = logging.getLogger(__name__)
KIND = "volume"
IMAGE = "volume.img"


def _users(manager: VMManager, volume_id: str) -> list[str]:
    return sorted(sb.id for sb in manager.vms() if any(v.id == volume_id for v in sb.spec.volumes))


def _checked(manager: VMManager, volume_id: str) -> None:
    if not VOLUME_ID.match(volume_id):
        raise InvalidArgument(f"volume id {volume_id!r} must match {VOLUME_ID.pattern}")
    if manager.artifacts is None:
        raise InvalidArgument("this worker has no registry")
    if users := _users(manager, volume_id):
        raise VolumeInUse(f"volume {volume_id} is attached to {', '.join(users)}")


async def push(manager: VMManager, volume_id: str, generation: int) -> str:
    """The volume's image as it is now, in the registry; refused while a sandbox here has it.
    A push asked for again, of the same `generation`, while one is under way is that one."""
    _checked(manager, volume_id)
    pushes, key = manager.volumes.pushes, (volume_id, generation)
    if key not in pushes:
        task = asyncio.ensure_future(_push(manager, volume_id))
        pushes[key] = task
        task.add_done_callback(lambda _: pushes.pop(key, None))
    return await asyncio.shield(pushes[key])


async def _push(manager: VMManager, volume_id: str) -> str:
    assert manager.artifacts is not None
    image = manager.volumes.image(volume_id)
    if not image.exists():
        raise InvalidArgument(f"this worker has no image of volume {volume_id}")
    writers = manager.volumes.writers.get(volume_id, 0)
    # A reflink of it at this instant is what goes: a sandbox attaching meanwhile writes its own.
    stage = Path(tempfile.mkdtemp(prefix=".push-", dir=manager.volumes.dir))
    try:
        await asyncio.to_thread(clone_file, image, stage / IMAGE)
        pushed = await manager.artifacts.push(
            KIND, volume_id, uuid.uuid4().hex, stage, {"id": volume_id}, log.info
        )
    finally:
        await asyncio.to_thread(shutil.rmtree, stage, True)
    # Attached meanwhile (even by a sandbox gone since): this copy is no longer that push.
    if not _users(manager, volume_id) and manager.volumes.writers.get(volume_id, 0) == writers:
        write_durable(manager.volumes.marker(volume_id), pushed.reference)
    return pushed.reference


async def adopt(manager: VMManager, volume_id: str, artifact: str, size_mib: int) -> None:
    """This worker's copy of the volume is the push `artifact` names: pulled unless it is."""
    _checked(manager, volume_id)
    assert manager.artifacts is not None
    marker = manager.volumes.marker(volume_id)
    async with manager.locks.hold(f"volume/{volume_id}"):
        if marker.exists() and marker.read_text() == artifact:
            return
        dest = manager.volumes.dir / f".pull-{volume_id}"
        await asyncio.to_thread(shutil.rmtree, dest, True)
        try:
            plan = await manager.artifacts.pull(artifact, KIND, volume_id, dest, log.info)
            if [f.path for f in plan.files] != [IMAGE] or plan.files[0].size > size_mib << 20:
                raise ImageError(f"{artifact} is no image of volume {volume_id}")
            await asyncio.to_thread(fsync_tree, dest)
            _checked(manager, volume_id)  # nothing attached it here meanwhile
            marker.unlink(missing_ok=True)  # no copy is that push until the image is in place
            rename_durable(dest / IMAGE, manager.volumes.image(volume_id))
            write_durable(marker, artifact)
        finally:
            await asyncio.to_thread(shutil.rmtree, dest, True)

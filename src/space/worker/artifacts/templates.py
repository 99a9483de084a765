"""Templates through the registry: each build pushed once it is made, and pulled by a worker
that is asked for a sandbox of a build it does not hold, so a template runs on any worker."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING

from space.worker.api.models import TemplateBuild
from space.worker.artifacts.store import Artifacts, Pushed
from space.worker.artifacts.trust import foreign_snapshot_problem
from space.worker.templates import TemplateRecord
from space.worker.templates.builder import TEMPLATES_DIR
from space.worker.templates.errors import ImageError
from space.worker.templates.record import RECORD_FILE
from space.worker.vmm.base import SnapshotInfo, VMMError

if TYPE_CHECKING:
    from space.worker.sandboxes import VMManager

log = logging.getLogger(__name__)
KIND = "template"


async def push(artifacts: Artifacts, record: TemplateRecord, say: Callable[[str], None]) -> Pushed:
    """The build's directory (disk, record, a checkpoint's snapshot), tagged by its digest."""
    return await artifacts.push(KIND, record.name, record.digest, record.path,
                                {"digest": record.digest}, say)  # fmt: skip


async def ensure(manager: VMManager, name: str, build: TemplateBuild) -> None:
    """Pull `build` of template `name` unless this worker has it, and use it."""
    held = manager.records.get(name)
    if manager.artifacts is None or (held is not None and held.digest == build.digest):
        return
    dest = manager.pool.root / TEMPLATES_DIR / name / build.digest
    if not (dest / RECORD_FILE).is_file():
        await manager.artifacts.pull(build.artifact, KIND, name, dest, log.info)
    why: str | None = None
    try:
        record = await asyncio.to_thread(TemplateRecord.load, dest)
        if (record.name, record.digest) != (name, build.digest):
            why = f"it holds template {record.name} {record.digest}"
        elif record.snapshot_path is not None:  # made of a checkpoint, on another host
            snap = SnapshotInfo.load(record.snapshot_path)
            why = foreign_snapshot_problem(manager.templates["base"], snap)
    except (OSError, ValueError, KeyError, TypeError, VMMError) as e:
        why = f"its template.json or snapshot does not load: {e}"
    if why is not None:
        await asyncio.to_thread(shutil.rmtree, dest, True)
        raise ImageError(f"{build.artifact}: {why}, not {name} {build.digest}")
    manager.refresh_templates()
    # The control plane's build, even if this worker holds one it thinks newer (its own, not
    # pushed; or another host's clock ahead).
    manager.use_template(record)

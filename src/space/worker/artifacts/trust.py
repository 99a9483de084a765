"""What a worker trusts of a snapshot made on another host."""

from __future__ import annotations

from typing import TYPE_CHECKING

from space.worker.machine import BootImages
from space.worker.vmm.base import SnapshotInfo

if TYPE_CHECKING:  # the sandboxes package imports this module
    from space.worker.sandboxes.records import SandboxVM


def foreign_snapshot_problem(
    base: BootImages, snap: SnapshotInfo, sb: SandboxVM | None = None
) -> str | None:
    """Why a snapshot made on another host must not run here: it is trusted with nothing of
    this host's but its own files, its empty slots (remapped at the restore) and this worker's
    guest kernel (`base`'s)."""
    config = snap.config
    if (config.kernel, config.initrd) != (base.kernel, base.initrd):
        return f"it was made with another guest kernel ({config.kernel})"
    if config.memory_file is not None:
        return "its memory is a file outside it"
    if any(not d.placeholder for d in config.drives):
        return "it has volumes, which are another host's"
    if sb is not None and sb.spec.volumes:
        return "its sandbox.json names volumes, which are another host's"
    return None

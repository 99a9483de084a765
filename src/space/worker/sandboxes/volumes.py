"""Volumes on a worker: their images in the pool, the drives a VM gets, and the one-writer rule.

A volume is an ext4 image of its own under `<pool>/volumes/`, made on first use. The database
already allows one writer or any readers per volume, but only the worker knows what its VMs
really hold (a sandbox deleted while this worker was away may still run here), so it checks
again before any VM gets a volume, counting suspended and crashed sandboxes too.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from space.worker.api.models import VOLUME_ID, VOLUME_SLOTS
from space.worker.sandboxes.errors import InvalidArgument, VMManagerError, VolumeInUse
from space.worker.sandboxes.records import SandboxVM, VolumeMount
from space.worker.vmm.base import Drive


class Volumes:
    def __init__(self, directory: Path, empty_slot: Path) -> None:
        self.dir = directory
        self.empty_slot = empty_slot
        self.pushes: dict[tuple[str, int], asyncio.Task[str]] = {}  # to the registry, under way
        self.writers: dict[str, int] = {}  # attachments that may write, ever, per volume

    def clean(self) -> None:
        """What was cut short: an image being made, a push or a pull (directories)."""
        for tmp in self.dir.glob(".*"):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                tmp.unlink(missing_ok=True)

    def image(self, volume_id: str) -> Path:
        return self.dir / f"{volume_id}.img"

    def marker(self, volume_id: str) -> Path:
        """Names the push in the registry the image is a copy of, while it is one."""
        return self.dir / f"{volume_id}.artifact"

    def check_writers(
        self, vm_id: str, volumes: Sequence[VolumeMount], others: Iterable[SandboxVM]
    ) -> None:
        """One writer or any readers per volume, among every sandbox this worker holds."""
        holders: dict[str, list[tuple[str, bool]]] = {}
        for sb in others:
            if sb.id == vm_id:
                continue
            for v in sb.spec.volumes:
                holders.setdefault(v.id, []).append((sb.id, v.read_only))
        for v in volumes:
            users = holders.get(v.id, [])
            writers = [sid for sid, ro in users if not ro]
            if writers:
                raise VolumeInUse(
                    f"volume {v.id} is attached read-write to {', '.join(writers)} on this worker",
                    writers,
                )
            if users and not v.read_only:
                names = ", ".join(sid for sid, _ in users)
                raise VolumeInUse(
                    f"volume {v.id} is attached read-only to {names} on this worker: no writer "
                    "meanwhile",
                    [sid for sid, _ in users],
                )

    async def drives(self, volumes: Sequence[VolumeMount]) -> tuple[Drive, ...]:
        """The VM's extra drives: its volumes' images (made on first use), then empty slots."""
        out = []
        for v in volumes:
            if not v.read_only:
                self.writers[v.id] = self.writers.get(v.id, 0) + 1
                self.marker(v.id).unlink(missing_ok=True)  # it may be written from now on
            image = self.image(v.id)
            if not image.exists():
                await asyncio.to_thread(_make_volume, image, v.size_mib)
            out.append(Drive(image, v.id, v.read_only))
        empty = [Drive(self.empty_slot, f"empty{i}", placeholder=True)
                 for i in range(len(out), VOLUME_SLOTS)]  # fmt: skip
        return (*out, *empty)

    def growth_mib(self) -> int:
        """What the volume images here may still grow by (they are sparse)."""
        total = 0
        for image in self.dir.glob("*.img"):
            st = image.stat()
            total += max(0, st.st_size - st.st_blocks * 512) >> 20
        return total

    def delete(self, volume_id: str, holders: Iterable[SandboxVM]) -> bool:
        """Remove a volume's image; False if this worker has none."""
        if not VOLUME_ID.match(volume_id):
            raise InvalidArgument(f"volume id {volume_id!r} must match {VOLUME_ID.pattern}")
        users = sorted(sb.id for sb in holders if any(v.id == volume_id for v in sb.spec.volumes))
        if users:
            raise VolumeInUse(f"volume {volume_id} is attached to {', '.join(users)}")
        image = self.image(volume_id)
        self.marker(volume_id).unlink(missing_ok=True)
        if not image.exists():
            return False
        image.unlink()
        return True


def check_volumes(volumes: Sequence[VolumeMount]) -> None:
    if len(volumes) > VOLUME_SLOTS:
        raise InvalidArgument(f"at most {VOLUME_SLOTS} volumes per sandbox")
    paths = [os.path.normpath(v.path) for v in volumes]
    for v, path in zip(volumes, paths, strict=True):
        if not VOLUME_ID.match(v.id):
            raise InvalidArgument(f"volume id {v.id!r} must match {VOLUME_ID.pattern}")
        if not path.startswith("/") or path == "/":
            raise InvalidArgument(f"volume {v.id}: mount path {v.path!r} must be absolute, not /")
    if len(set(paths)) != len(paths) or len({v.id for v in volumes}) != len(volumes):
        raise InvalidArgument("each volume and each mount path may appear once")


def _make_volume(image: Path, size_mib: int) -> None:
    """An empty ext4 volume, sparse; made under a temporary name so a crash leaves no half."""
    tmp = image.with_name(f".{image.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size_mib << 20)
        os.chmod(tmp, 0o600)
        r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(tmp)],
                           capture_output=True, text=True, check=False)  # fmt: skip
        if r.returncode != 0:
            raise VMManagerError(f"mkfs.ext4 of volume {image.stem} failed: {r.stderr.strip()}")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.rename(image)
    finally:
        tmp.unlink(missing_ok=True)

"""The worker's disk pool: a directory on a file system that can clone files copy-on-write.

The pool is an existing btrfs (or reflink-capable XFS) directory, or a sparse image file that
the worker formats as btrfs and loop-mounts itself. Templates are imported into the pool once;
every VM disk and snapshot disk is then a reflink of them, instant and free until written.
"""

from __future__ import annotations

import logging
import os
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from space import paths
from space.worker.storage.reflink import ReflinkUnsupported, clone_file, reflink

log = logging.getLogger(__name__)

DEFAULT_IMAGE_GIB = 64


class PoolError(Exception):
    pass


@dataclass(frozen=True)
class Pool:
    root: Path
    reflinks: bool  # False: every clone is a full copy (and the worker said so)

    @property
    def vms(self) -> Path:
        return self.root / "vms"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def templates(self) -> Path:
        return self.root / "templates"

    def import_image(self, src: Path, key: str) -> Path:
        """The pool's copy of a template image (made once), so clones of it can be reflinks."""
        dest = self.templates / key / src.name
        if dest.exists():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        try:
            clone_file(src, tmp)
            os.chmod(tmp, 0o444)  # templates are immutable
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest


def _fs_type(path: Path) -> str:
    out = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def _is_mountpoint(path: Path) -> bool:
    return subprocess.run(["mountpoint", "-q", str(path)], check=False).returncode == 0


def _supports_reflink(directory: Path) -> bool:
    probe = directory / f".reflink-probe-{uuid.uuid4().hex[:8]}"
    copy = probe.with_suffix(".clone")
    try:
        probe.write_bytes(b"space")
        reflink(probe, copy)
        return True
    except ReflinkUnsupported:
        return False
    finally:
        probe.unlink(missing_ok=True)
        copy.unlink(missing_ok=True)


def ensure_pool(
    root: Path | None = None,
    image: Path | None = None,
    size_gib: int | None = None,
    *,
    directory: Path | None = None,
    state_dir: Path | None = None,
) -> Pool:
    """Find or make the pool: `directory` (SPACE_POOL_DIR) names an existing reflink-capable
    directory; otherwise a sparse image of `size_gib` (SPACE_POOL_IMAGE_GIB, default 64) GiB is
    made in the state directory and mounted."""
    if size_gib is None:
        size_gib = DEFAULT_IMAGE_GIB
    if root is None and directory is not None:
        root = directory
        root.mkdir(parents=True, exist_ok=True)
        return _checked(root)
    state = state_dir or paths.state_dir()
    root = root or state / "pool"
    image = image or state / "pool.img"
    root.mkdir(parents=True, exist_ok=True)
    if _is_mountpoint(root):
        return _checked(root)
    if not image.exists():
        log.info("creating a %d GiB sparse btrfs pool image at %s", size_gib, image)
        image.parent.mkdir(parents=True, exist_ok=True)
        with open(image, "wb") as f:
            f.truncate(size_gib << 30)
        _run(["mkfs.btrfs", "-q", "-L", "space-pool", str(image)])
    _run(["mount", "-o", "loop,noatime,discard=async", str(image), str(root)])
    return _checked(root)


def _checked(root: Path) -> Pool:
    reflinks = _supports_reflink(root)
    if not reflinks:
        log.warning(
            "pool %s (%s) cannot reflink: every VM disk will be a full copy; use btrfs or XFS",
            root,
            _fs_type(root) or "unknown file system",
        )
    pool = Pool(root=root, reflinks=reflinks)
    for d in (pool.vms, pool.snapshots, pool.templates):
        d.mkdir(parents=True, exist_ok=True)
    return pool


def _run(argv: list[str]) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise PoolError(f"{argv[0]} not found: install btrfs-progs and util-linux") from None
    except subprocess.CalledProcessError as e:
        raise PoolError(f"{' '.join(argv)} failed: {e.stderr.strip()}") from None

"""Where SPACE keeps disks: a pool that clones files copy-on-write (space.worker.storage.pool),
and free space for it and for the cache of images."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from space.doctor.host import Host
from space.doctor.model import Check, Status
from space.worker.storage.pool import _fs_type, _is_mountpoint
from space.worker.storage.reflink import ReflinkUnsupported, reflink

GIB = 1 << 30
# Sandbox disks are reflinks and cost only what sandboxes write; templates, base snapshots
# (a VM's memory, ~90 MB each) and suspended sandboxes take real space.
POOL_FAIL_GIB, POOL_WARN_GIB = 2, 10
# The guest kernel (~60 MB), Debian packages, the mmdebstrap tarball and the `base` image.
CACHE_FAIL_GIB, CACHE_WARN_GIB = 1, 4


def check_pool(host: Host) -> Check:
    root = host.pool_root
    if host.pool_dir is not None or (root.is_dir() and _is_mountpoint(root)):
        return _reflink_check(root, configured=host.pool_dir is not None)
    # Not made yet (or not mounted since a reboot): the worker makes a sparse btrfs image and
    # loop-mounts it; that takes btrfs in the kernel and mkfs.btrfs.
    image = host.state_dir / "pool.img"
    missing = []
    if not _kernel_has_btrfs(host):
        missing.append("this kernel has no btrfs (`modprobe btrfs`)")
    if not image.exists() and shutil.which("mkfs.btrfs") is None:
        missing.append("mkfs.btrfs is not installed (package btrfs-progs)")
    if missing:
        return Check(
            "pool", "fail", "; ".join(missing),
            f"The worker makes its pool as a btrfs image ({image}) mounted at {root}: without "
            "btrfs it cannot start.",
            "`apt-get install btrfs-progs` and `modprobe btrfs`; or point SPACE_POOL_DIR at an "
            "existing btrfs or XFS (reflink) directory",
        )  # fmt: skip
    made = "is there" if image.exists() else "will be made"
    return Check("pool", "ok", f"the btrfs pool image {image} {made}; the worker mounts it at "
                               f"{root} (reflinks: btrfs has them)")  # fmt: skip


def _reflink_check(root: Path, configured: bool) -> Check:
    where = _existing(root)
    fs = _fs_name(where)
    try:
        with tempfile.TemporaryDirectory(prefix=".space-doctor-", dir=where) as tmp:
            source, clone = Path(tmp) / "source", Path(tmp) / "clone"
            source.write_bytes(os.urandom(64 << 10))
            reflink(source, clone)
            if clone.read_bytes() != source.read_bytes():
                raise ReflinkUnsupported(0, "the clone differs from its source")
    except ReflinkUnsupported:
        fix = ("put SPACE_POOL_DIR on btrfs or XFS made with reflink=1, or unset it: the worker "
               "then makes a btrfs image of its own") if configured else (
               f"mount a btrfs or XFS (reflink=1) file system at {root}")  # fmt: skip
        return Check(
            "pool", "warn", f"{where} ({fs}) cannot clone files (FICLONE)",
            "Every sandbox disk and snapshot will be a full copy: creates take seconds instead "
            "of milliseconds, and each sandbox costs its whole disk in real space.",
            fix,
        )  # fmt: skip
    except OSError as e:
        return Check("pool", "fail", f"cannot write in the pool {where}: {e.strerror or e}",
                     "The worker keeps every VM disk there.",
                     "run as root, and make the directory writable")  # fmt: skip
    return Check("pool", "ok", f"{where} ({fs}) clones files copy-on-write (FICLONE works)")


def _kernel_has_btrfs(host: Host) -> bool:
    try:
        if "btrfs" in (host.paths.proc / "filesystems").read_text().split():
            return True
    except OSError:
        pass
    # Not loaded yet: mounting loads the module, if this kernel has it.
    release = os.uname().release
    return any(Path(f"/lib/modules/{release}").glob("kernel/fs/btrfs/btrfs.ko*"))


def _fs_name(path: Path) -> str:
    # findmnt lists every mount stacked there; the last one is what `path` is on.
    names = _fs_type(path).splitlines()
    return names[-1] if names else "unknown file system"


def _existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (what the worker will make it on)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _space_check(
    check_id: str, paths: list[Path], what: str, fail_gib: int, warn_gib: int, fix: str
) -> Check:
    """Free space for `what`, which lives on every one of `paths` (the least free one counts)."""
    free_bytes, where = min((shutil.disk_usage(w).free, w) for w in map(_existing, paths))
    free = free_bytes / GIB
    status: Status = "fail" if free < fail_gib else "warn" if free < warn_gib else "ok"
    summary = f"{free:.1f} GiB free for {what}: {where} ({_fs_name(where)})"
    if status == "ok":
        return Check(check_id, "ok", summary)
    return Check(
        check_id, status, summary,
        f"SPACE wants at least {warn_gib} GiB there" + (
            f"; below {fail_gib} GiB builds and snapshots fail" if status == "fail" else
            ": templates, snapshots and suspended sandboxes may fill it"),
        fix,
    )  # fmt: skip


def check_pool_space(host: Host) -> Check:
    # A pool image is sparse: what it holds also takes room on the file system under it.
    paths = [host.pool_root] if host.pool_dir else [host.pool_root, host.state_dir / "pool.img"]
    return _space_check(
        "disk.pool", paths, "the pool (templates, snapshots, sandbox disks)",
        POOL_FAIL_GIB, POOL_WARN_GIB,
        "free space there (`space template prune`, delete suspended sandboxes), or set "
        "SPACE_POOL_DIR / SPACE_STATE_DIR to a larger file system",
    )  # fmt: skip


def check_cache_space(host: Host) -> Check:
    return _space_check(
        "disk.cache", [host.cache_dir], "the image cache (kernel, packages, base image)",
        CACHE_FAIL_GIB, CACHE_WARN_GIB,
        "free space there, or set SPACE_CACHE_DIR to a larger file system",
    )  # fmt: skip

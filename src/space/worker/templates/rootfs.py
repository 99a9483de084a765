"""A root directory turned into the ext4 image a SPACE VM boots, and the check that it can.

Our initramfs mounts the image, then `switch_root`s into `/usr/bin/python3 -E -s
/run/space/space-agent` (see `space.worker.images.kernel`): the guest agent runs on the
template's own python3, so an image without one cannot boot, and is refused here, before any VM
is started, with a message that says what to add. `/run`, `/dev`, `/proc` and `/sys` are made by
the initramfs when missing.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from space.worker.images import debs
from space.worker.images.base import LABEL
from space.worker.templates.errors import BuildError, NotBootable
from space.worker.templates.oci import RootDir

Log = debs.Log
PYTHON = "/usr/bin/python3"
MIB = 1 << 20
# Room for the build steps to install things; a sandbox disk is grown at create anyway.
DEFAULT_HEADROOM = 512 * MIB


def check_bootable(root: Path) -> None:
    """Raise NotBootable unless `root` has an executable /usr/bin/python3 (links followed)."""
    rd = RootDir(root)
    python = rd.resolve(PYTHON.strip("/").split("/"))
    try:
        st = python.stat()
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
        raise NotBootable(
            f"the image has no usable {PYTHON}: SPACE's guest agent runs on the template's own "
            "python3 (standard library only), so the image needs one (e.g. `apt-get install "
            "python3-minimal`, `apk add python3`, or a python:*-slim base image)"
        )


def ensure_dir(root: Path, path: str) -> None:
    """Make the directory `path` of the image (links resolved inside the root)."""
    rd = RootDir(root)
    rd.ensure_dir(rd.resolve([p for p in path.split("/") if p]))


def tree_usage(root: Path) -> tuple[int, int]:
    """(bytes allocated, number of inodes) of a directory tree; hard links counted once."""
    seen: set[tuple[int, int]] = set()
    used, inodes = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            inodes += 1
            used += max(st.st_blocks * 512, 4096 if stat.S_ISDIR(st.st_mode) else 0)
    return used, inodes


def image_size(used: int, *, headroom: int = DEFAULT_HEADROOM) -> int:
    """Content plus a quarter for ext4's own metadata, plus headroom, in whole 64 MiB."""
    raw = used + used // 4 + headroom
    step = 64 * MIB
    return max(step * 4, -(-raw // step) * step)


def make_ext4(root: Path, image: Path, log: Log, *, size_bytes: int | None = None) -> int:
    """Write `root` into a new sparse ext4 image (`mkfs.ext4 -d`, no mount); returns its size."""
    used, inodes = tree_usage(root)
    size = size_bytes or image_size(used)
    if size % 4096:
        raise BuildError(f"disk size {size} is not a multiple of 4 KiB")
    if size < used:
        raise BuildError(
            f"disk size {size >> 20} MiB is smaller than the image's {used >> 20} MiB of files"
        )
    log(f"mkfs.ext4 -d: {used / 1e6:.0f} MB in {inodes} files -> {size >> 20} MiB image")
    image.unlink(missing_ok=True)
    # -N: enough inodes for the files plus as many again for what builds and sandboxes add.
    inode_count = str(max(inodes * 2 + 16384, 65536))
    argv = ["mkfs.ext4", "-q", "-F", "-L", LABEL, "-N", inode_count, "-d", str(root), str(image)]
    debs.run_streamed([*argv, f"{size // 1024}k"], log, what="mkfs.ext4")
    return size


def grow_ext4(image: Path, size_bytes: int, log: Log) -> None:
    """Make an (unused, unmounted) ext4 image `size_bytes` large; never shrinks it."""
    if size_bytes <= image.stat().st_size:
        return
    log(f"growing {image.name} to {size_bytes >> 20} MiB")
    os.truncate(image, size_bytes)
    # resize2fs insists on a checked file system first; -p repairs only what is safe.
    debs.run_streamed(["e2fsck", "-f", "-p", image], log, what="e2fsck")
    debs.run_streamed(["resize2fs", image], log, what="resize2fs")

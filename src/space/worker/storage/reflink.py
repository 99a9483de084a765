"""Copy-on-write file clones (FICLONE), with a loud, never silent, fallback to a real copy."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

FICLONE = 0x40049409
# What FICLONE answers on a file system (or a pair of them) that cannot share extents.
_NO_REFLINK = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS}


class ReflinkUnsupported(OSError):
    @property
    def across(self) -> bool:
        """The source is on another file system: the destination's may well clone."""
        return self.errno == errno.EXDEV


def reflink(src: Path, dst: Path) -> None:
    """Make `dst` share all of `src`'s extents; raises ReflinkUnsupported where it cannot."""
    with open(src, "rb") as fsrc:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(fd, FICLONE, fsrc.fileno())
        except OSError as e:
            os.close(fd)
            os.unlink(dst)
            if e.errno in _NO_REFLINK:
                raise ReflinkUnsupported(e.errno, f"{dst.parent} cannot reflink {src}") from e
            raise
        os.close(fd)


def clone_file(src: Path, dst: Path) -> bool:
    """Clone `src` to `dst`; True if it was a reflink, False if the data had to be copied."""
    try:
        reflink(src, dst)
        return True
    except ReflinkUnsupported as e:
        if e.across:  # an image entering the pool from a cache elsewhere, say
            log.info("copying %s into %s in full: a reflink cannot cross file systems", src, dst)
        else:
            log.warning(
                "%s does not support reflinks: copying %s in full (slow, and uses real disk "
                "space); put the worker's pool on btrfs or XFS with reflink",
                dst.parent,
                src,
            )
    if shutil.which("cp") is None:
        raise OSError(f"cannot copy {src}: no cp")
    # cp keeps holes, so a sparse image stays sparse.
    subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True)
    os.chmod(dst, 0o600)
    return False

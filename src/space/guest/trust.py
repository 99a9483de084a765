"""The platform's CA in the guest's trust: /etc/space/ca.pem, and ca-bundle.pem beside it (the
system's CAs, then ours), each replaced atomically, root-owned, mode 0644.

The tenant is root in the guest and may have set traps: /etc/space a symbolic link (refused:
nothing is written through it), the files there links (replaced, never written through), the
system bundle a huge file or a FIFO (only a regular file of at most MAX_SYSTEM_BUNDLE bytes is
read, without blocking on open).
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import TYPE_CHECKING

from . import protocol as p
from .common import Json, OpError, blocking, os_error, str_arg

if TYPE_CHECKING:
    from .agent import Connection

ETC = "/etc"
CA_DIR = "space"
CA_FILE = "ca.pem"
BUNDLE_FILE = "ca-bundle.pem"
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
MAX_CA = 64 * 1024
MAX_SYSTEM_BUNDLE = 4 << 20  # Debian's is about 0.2 MB
BEGIN, END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


async def install_ca(conn: Connection, channel: int, req: Json) -> Json:
    pem = str_arg(req, "pem")
    if len(pem) > MAX_CA or not pem.isascii() or BEGIN not in pem or END not in pem:
        raise OpError(
            p.ErrorCode.INVALID, f"'pem' must be PEM certificates, at most {MAX_CA} bytes"
        )
    return await blocking(install, pem.encode())


def install(pem: bytes, etc: str = ETC, system_bundle: str = SYSTEM_BUNDLE) -> Json:
    """Write the CA and the bundle under `etc`/space (blocking; the arguments are for tests)."""
    directory = os.path.join(etc, CA_DIR)
    system = _read_system_bundle(system_bundle)
    bundle = pem if system is None else system + (b"" if system.endswith(b"\n") else b"\n") + pem
    dir_fd = _ca_dir(etc, directory)
    try:
        _replace(dir_fd, CA_FILE, pem, directory)
        _replace(dir_fd, BUNDLE_FILE, bundle, directory)
    finally:
        os.close(dir_fd)
    return {
        "ca": os.path.join(directory, CA_FILE),
        "bundle": os.path.join(directory, BUNDLE_FILE),
        "bundle_size": len(bundle),
        "system_bundle": system is not None,
    }


def _ca_dir(etc: str, directory: str) -> int:
    """`directory`, made if missing, opened without following a link; root's, 0755."""
    try:
        etc_fd = os.open(etc, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise os_error(e, etc) from None
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(CA_DIR, 0o755, dir_fd=etc_fd)
        try:
            fd = os.open(
                CA_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=etc_fd
            )
        except OSError as e:
            if stat.S_ISLNK(os.lstat(CA_DIR, dir_fd=etc_fd).st_mode):
                raise OpError(
                    p.ErrorCode.INVALID, f"{directory} is a symbolic link; nothing is written there"
                ) from None
            raise os_error(e, directory) from None
    except OSError as e:
        raise os_error(e, directory) from None
    finally:
        os.close(etc_fd)
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o755)
    except OSError as e:
        os.close(fd)
        raise os_error(e, directory) from None
    return fd


def _replace(dir_fd: int, name: str, data: bytes, directory: str) -> None:
    """`name` in `dir_fd` becomes `data` at once (a new file renamed over whatever was there)."""
    tmp = f".{name}.{os.urandom(4).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    path = os.path.join(directory, name)
    try:
        fd = os.open(tmp, flags, 0o644, dir_fd=dir_fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o644)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise os_error(e, path) from None


def _read_system_bundle(path: str) -> bytes | None:
    """The system's CA bundle, None if there is none; refused if it is no regular file or too
    large. (A link is followed: some systems make the bundle one.)"""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise os_error(e, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OpError(p.ErrorCode.INVALID, f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= MAX_SYSTEM_BUNDLE:
            chunk = os.read(fd, min(1 << 20, MAX_SYSTEM_BUNDLE + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise os_error(e, path) from None
    finally:
        os.close(fd)
    if size > MAX_SYSTEM_BUNDLE:
        raise OpError(
            p.ErrorCode.INVALID, f"{path} is larger than the {MAX_SYSTEM_BUNDLE} bytes allowed"
        )
    return b"".join(chunks)

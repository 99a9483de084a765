"""Files in the guest: streamed reads, atomic streamed writes, listing, metadata, renames."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from typing import TYPE_CHECKING

from . import protocol as p
from .common import Json, OpError, check_path, os_error, path_arg, str_arg

if TYPE_CHECKING:
    from .agent import Connection

LIST_LIMIT = 1000  # entries of a listing unless asked otherwise
MAX_LIST_LIMIT = 10_000
LIST_BYTES = p.MAX_JSON - 1024  # a listing's entries fit one reply


def stat_entry(path: str, name: str | None = None) -> Json:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISDIR(st.st_mode):
        kind = "directory"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    else:
        kind = "other"
    entry: Json = {
        "name": name if name is not None else os.path.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(st.st_mode),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "mtime": st.st_mtime,
    }
    if kind == "symlink":
        entry["target"] = os.readlink(path)
    return entry


async def read_file(conn: Connection, channel: int, req: Json) -> Json:
    path = path_arg(req)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise os_error(e, path) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise OpError(p.ErrorCode.IS_A_DIRECTORY, f"{path}: is a directory")
        await conn.send_json(p.FrameType.EVENT, channel, {"size": st.st_size})
        sent = 0
        while True:
            try:
                chunk = os.read(fd, p.CHUNK_SIZE)
            except OSError as e:
                raise os_error(e, path) from None
            if not chunk:
                break
            sent += len(chunk)
            await conn.send(p.FrameType.DATA, channel, chunk)
        await conn.send(p.FrameType.END, channel)
        return {"size": sent}
    finally:
        os.close(fd)


async def write_file(conn: Connection, channel: int, req: Json) -> Json:
    """Streams DATA frames into a temporary file renamed over `path` at END: all or nothing."""
    path = path_arg(req)
    mode = req.get("mode", 0o644)
    if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise OpError(p.ErrorCode.INVALID, "'mode' must be a permission number")
    parent = os.path.dirname(path) or "/"
    if req.get("make_parents"):
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as e:
            raise os_error(e, parent) from None
    if os.path.isdir(path):
        raise OpError(p.ErrorCode.IS_A_DIRECTORY, f"{path}: is a directory")
    tmp = os.path.join(parent, f".{os.path.basename(path)}.space-{os.urandom(4).hex()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    except OSError as e:
        raise os_error(e, path) from None
    queue = conn.inboxes[channel]
    await conn.send_json(p.FrameType.EVENT, channel, {"ready": True, "window": p.DATA_WINDOW})
    written = 0
    failure: OpError | None = None
    try:
        while True:
            ftype, data = await queue.get()
            if ftype == p.FrameType.END:
                break
            if ftype != p.FrameType.DATA:
                continue
            if failure is None:  # after a failure, drain the host's data until its END
                try:
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    written += len(data)
                except OSError as e:
                    failure = os_error(e, path)
            await conn.send_json(p.FrameType.EVENT, channel, {"ack": len(data)})
        if failure is None:
            os.fchmod(fd, mode)
            os.fsync(fd)
    except OSError as e:
        failure = os_error(e, path)
    finally:
        os.close(fd)
        if failure is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if failure is not None:
        raise failure
    try:
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise os_error(e, path) from None
    return {"size": written}


async def list_dir(conn: Connection, channel: int, req: Json) -> Json:
    """At most `limit` entries, in name order, as many as fit a reply; `truncated` says there
    were more (which ones were left out is then unspecified)."""
    path = path_arg(req)
    limit = req.get("limit", LIST_LIMIT)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise OpError(p.ErrorCode.INVALID, f"'limit' must be 1-{MAX_LIST_LIMIT}")
    names: list[str] = []
    truncated = False
    try:
        with os.scandir(path) as found:
            for found_entry in found:
                if len(names) == limit:
                    truncated = True
                    break
                names.append(found_entry.name)
    except OSError as e:
        raise os_error(e, path) from None
    entries, size = [], 0
    for name in sorted(names):
        try:
            entry = stat_entry(os.path.join(path, name), name)
        except FileNotFoundError:  # removed while we looked
            continue
        size += len(json.dumps(entry, separators=(",", ":"))) + 1
        if size > LIST_BYTES:
            truncated = True
            break
        entries.append(entry)
    return {"entries": entries, "truncated": truncated}


async def stat_path(conn: Connection, channel: int, req: Json) -> Json:
    path = path_arg(req)
    try:
        return stat_entry(path)
    except OSError as e:
        raise os_error(e, path) from None


async def remove(conn: Connection, channel: int, req: Json) -> Json:
    path = path_arg(req)
    if os.path.normpath(path) == "/":
        raise OpError(p.ErrorCode.INVALID, "refusing to remove /")
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            if req.get("recursive"):
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)
    except OSError as e:
        raise os_error(e, path) from None
    return {}


RENAME_NOREPLACE = 1


def _rename_noreplace(source: str, target: str) -> None:
    """rename(2) that fails with EEXIST rather than replace `target`, in one step (renameat2);
    where the C library lacks it, a check first (a guest's own race, at worst)."""
    try:
        import ctypes  # only here: the agent starts without it

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (ImportError, OSError, AttributeError):
        if os.path.lexists(target):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST)) from None
        os.rename(source, target)
        return
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(source), at_fdcwd, os.fsencode(target),
                 RENAME_NOREPLACE) != 0:  # fmt: skip
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


async def rename(conn: Connection, channel: int, req: Json) -> Json:
    """`path` becomes `to` in one step (a file or a directory, on one file system); an existing
    `to` is replaced only with `overwrite`."""
    path = path_arg(req)
    target = check_path(str_arg(req, "to"), "to")
    if os.path.normpath(path) == "/" or os.path.normpath(target) == "/":
        raise OpError(p.ErrorCode.INVALID, "refusing to rename / or onto /")
    try:
        if req.get("overwrite"):
            os.rename(path, target)
        else:
            _rename_noreplace(path, target)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise OpError(p.ErrorCode.INVALID, f"{path} and {target} are on different file "
                          "systems (a volume?): copy it instead") from None  # fmt: skip
        if e.errno == errno.EINVAL:
            raise OpError(p.ErrorCode.INVALID, f"cannot move {path} into itself") from None
        raise os_error(e, path if e.errno != errno.EEXIST else target) from None
    try:
        return stat_entry(target)
    except OSError as e:  # changed again by the guest meanwhile
        raise os_error(e, target) from None


async def mkdir(conn: Connection, channel: int, req: Json) -> Json:
    path = path_arg(req)
    mode = req.get("mode", 0o755)
    if not isinstance(mode, int):
        raise OpError(p.ErrorCode.INVALID, "'mode' must be a permission number")
    try:
        if req.get("parents"):
            os.makedirs(path, mode=mode, exist_ok=True)
        else:
            os.mkdir(path, mode)
    except OSError as e:
        raise os_error(e, path) from None
    return stat_entry(path)

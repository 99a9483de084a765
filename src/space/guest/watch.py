"""File watch: what changes in a directory (and, if asked, under it), from inotify(7).

Events are told as fsnotify-style kinds, the ones E2B's and most watch APIs use: `create` (also
the new name of a move), `write`, `remove`, `rename` (the old name of a move), `chmod`. A
recursive watch adds each directory created under it as it appears, and tells what that
directory already held by then as `create`s, so a tree made at once (`mkdir -p a/b; touch
a/b/f`) is not lost between the directory's creation and its watch.

Bounded both ways: at most MAX_DIRS directories per watch (a larger tree is refused at the start,
or told as `overflow` when it grows past that later); events wait in the kernel's queue while
the host does not read (`overflow` when it fills), never in the agent's memory.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

from . import protocol as p
from .common import Json, OpError, os_error, path_arg

if TYPE_CHECKING:
    from .agent import Connection

MAX_DIRS = 8192  # directories one recursive watch may cover
BATCH_BYTES = p.MAX_JSON - 4096  # the events of one EVENT frame, encoded
COALESCE_S = 0.02  # events that come together travel together

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF = 0x100, 0x200, 0x400, 0x800
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = 0x4000, 0x8000, 0x40000000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_EXCL_UNLINK = 0x01000000, 0x02000000, 0x04000000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
WATCHED = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
           | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR | IN_EXCL_UNLINK)  # fmt: skip
KINDS = ((IN_CREATE, "create"), (IN_MOVED_TO, "create"), (IN_MODIFY, "write"),
         (IN_DELETE, "remove"), (IN_MOVED_FROM, "rename"), (IN_ATTRIB, "chmod"))  # fmt: skip
HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)

_libc = ctypes.CDLL(None, use_errno=True)


class Watcher:
    """One inotify instance over a directory, or the tree under it."""

    def __init__(self, root: str, recursive: bool) -> None:
        self.root = root
        self.recursive = recursive
        self.dirs: dict[int, str] = {}  # watch descriptor → the directory it watches
        self.ended: str | None = None  # why the watch can go on no longer
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            err = ctypes.get_errno()
            raise OpError(p.ErrorCode.BUSY, f"no inotify instance: {os.strerror(err)}")
        try:
            self._add(root, IN_ONLYDIR)  # the root itself may be a link to a directory
            if recursive:
                for sub in _subdirs(root, MAX_DIRS):
                    self._add(sub)
                if len(self.dirs) > MAX_DIRS:
                    too_many = f"{root} holds more than {MAX_DIRS} directories to watch"
                    raise OpError(p.ErrorCode.INVALID, too_many)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _add(self, path: str, flags: int = IN_DONT_FOLLOW) -> bool:
        """Watch `path`; False if it is gone already (it was removed meanwhile)."""
        wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), WATCHED | flags)
        if wd < 0:
            err = ctypes.get_errno()
            if path != self.root and err in (errno.ENOENT, errno.ENOTDIR):
                return False
            if err == errno.ENOSPC:
                raise OpError(p.ErrorCode.NO_SPACE, "the guest's inotify watch limit is reached "
                              "(fs.inotify.max_user_watches)")  # fmt: skip
            raise os_error(OSError(err, os.strerror(err)), path)
        self.dirs[wd] = path
        return True

    def read(self) -> list[Json]:
        """The events the kernel holds now, in order."""
        events: list[Json] = []
        while True:
            try:
                buf = os.read(self.fd, 64 << 10)
            except BlockingIOError:
                return events
            for wd, mask, name in _parse(buf):
                events.extend(self._told(wd, mask, name))

    def _told(self, wd: int, mask: int, name: str) -> Iterator[Json]:
        if mask & IN_Q_OVERFLOW:
            yield {"type": "overflow"}
            return
        base = self.dirs.get(wd)
        if base is None:
            return
        if mask & IN_IGNORED:
            del self.dirs[wd]
        if mask & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED):
            if base == self.root:
                self.ended = "removed" if mask & (IN_DELETE_SELF | IN_IGNORED) else "moved"
            return
        path = os.path.join(base, name) if name else base
        is_dir = bool(mask & IN_ISDIR)
        for bit, kind in KINDS:
            if mask & bit:
                yield {"type": kind, "path": path, "is_dir": is_dir}
        if is_dir and self.recursive and mask & (IN_CREATE | IN_MOVED_TO):
            yield from self._grown(path)

    def _grown(self, path: str) -> Iterator[Json]:
        """A directory that appeared under a recursive watch: watched, and its contents told."""
        for sub in [path, *_subdirs(path, MAX_DIRS)]:
            if len(self.dirs) >= MAX_DIRS:
                yield {"type": "overflow", "path": sub}
                return
            if not self._add(sub):
                continue
            if sub != path:
                yield {"type": "create", "path": sub, "is_dir": True}
            for entry in _entries(sub):
                if not entry.is_dir(follow_symlinks=False):
                    yield {"type": "create", "path": entry.path, "is_dir": False}


def _parse(buf: bytes) -> Iterator[tuple[int, int, str]]:
    at = 0
    while at + HEADER.size <= len(buf):
        wd, mask, _cookie, length = HEADER.unpack_from(buf, at)
        raw = buf[at + HEADER.size : at + HEADER.size + length]
        at += HEADER.size + length
        yield wd, mask, os.fsdecode(raw.rstrip(b"\0"))


def _entries(path: str) -> Iterator[os.DirEntry[str]]:
    """The entries of a directory; none if it is gone or unreadable meanwhile."""
    try:
        with os.scandir(path) as entries:
            yield from entries
    except OSError:
        return


def _subdirs(root: str, limit: int) -> Iterator[str]:
    """The directories under `root` (links not followed), breadth first, at most limit + 1."""
    queue, found = [root], 0
    while queue:
        for entry in _entries(queue.pop(0)):
            if entry.is_dir(follow_symlinks=False):
                found += 1
                yield entry.path
                if found > limit:
                    return
                queue.append(entry.path)


async def watch(conn: Connection, channel: int, req: Json) -> Json:
    """Streams EVENT {events: [...]} until the host sends CONTROL {stop}, goes away, or the
    watched directory is removed or moved."""
    path = path_arg(req)
    recursive = req.get("recursive", False) is True
    watcher = Watcher(path, recursive)
    inbox = conn.inboxes[channel]
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(watcher.fd, readable.set)
    told = 0
    try:
        await conn.send_json(p.FrameType.EVENT, channel, {"watching": path, "recursive": recursive})
        stop = asyncio.ensure_future(_stopped(inbox))
        gone = asyncio.ensure_future(conn.gone.wait())
        try:
            while watcher.ended is None:
                ready = asyncio.ensure_future(readable.wait())
                await asyncio.wait([ready, stop, gone], return_when=asyncio.FIRST_COMPLETED)
                ready.cancel()
                if stop.done() or gone.done():
                    watcher.ended = "stopped" if stop.done() else "gone"
                    break
                await asyncio.sleep(COALESCE_S)
                readable.clear()
                events = watcher.read()
                for batch in _batches(events):
                    await conn.send_json(p.FrameType.EVENT, channel, {"events": batch})
                told += len(events)
        finally:
            stop.cancel()
            gone.cancel()
    finally:
        loop.remove_reader(watcher.fd)
        watcher.close()
    return {"events": told, "ended": watcher.ended}


async def _stopped(inbox: asyncio.Queue[tuple[p.FrameType, bytes]]) -> None:
    while True:
        ftype, payload = await inbox.get()
        if ftype == p.FrameType.END:
            return
        if ftype == p.FrameType.CONTROL:
            try:
                if p.decode_json(payload).get("stop") is True:
                    return
            except p.ProtocolError:
                continue


def _batches(events: list[Json]) -> Iterator[list[Json]]:
    batch: list[Json] = []
    size = 0
    for event in events:
        n = len(json.dumps(event)) + 2
        if batch and size + n > BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(event)
        size += n
    if batch:
        yield batch

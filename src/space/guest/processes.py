"""A process in the guest once started: its output read off its pipes or pty and passed to
whoever listens (and, for a background process, kept in a bounded ring for whoever attaches
later), its input, its signals, and how it ended."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import protocol as p
from .common import Json, OpError, gather_more
from .spawn import Spawned, set_winsize

if TYPE_CHECKING:
    from .agent import Connection

OUTPUT_RING = 1 << 20  # bytes of a background process's latest output kept for a reattach


class Reaper:
    """Collects every child's exit status (as PID 1 also the orphans') and wakes its waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiters: dict[int, asyncio.Future[int]] = {}
        loop.add_signal_handler(signal.SIGCHLD, self._reap)

    def watch(self, pid: int) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = self._loop.create_future()
        self._waiters[pid] = fut
        self._reap()  # it may have exited before we started watching
        return fut

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fut = self._waiters.pop(pid, None)
            if fut is not None and not fut.done():
                fut.set_result(status)


async def wait_readable(fd: int, also: asyncio.Event) -> None:
    """Until `fd` is readable or `also` is set."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def on_readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, on_readable)
    waiter = asyncio.ensure_future(also.wait())
    either: list[asyncio.Future[Any]] = [ready, waiter]
    try:
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_reader(fd)
        waiter.cancel()
        ready.cancel()


class OutputRing:
    """The latest `capacity` bytes of output, in order and by stream; what fell out is counted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: collections.deque[tuple[p.FrameType, bytes]] = collections.deque()
        self._size = 0
        self.dropped = 0

    def add(self, ftype: p.FrameType, data: bytes) -> None:
        if self.capacity <= 0:
            return
        self._chunks.append((ftype, data))
        self._size += len(data)
        while self._size > self.capacity:
            old_type, old = self._chunks.popleft()
            cut = min(len(old), self._size - self.capacity)
            if cut < len(old):
                self._chunks.appendleft((old_type, old[cut:]))
            self._size -= cut
            self.dropped += cut

    def __iter__(self) -> Iterator[tuple[p.FrameType, bytes]]:
        return iter(list(self._chunks))


@dataclass(frozen=True)
class Listener:
    conn: Connection
    channel: int


class Process:
    """One started process. Output goes to its listeners (each channel that follows it, in
    order: a listener added under `output_lock` sees nothing twice and misses nothing) and to
    its ring; it ends with `result` set and `done`."""

    def __init__(self, spawned: Spawned, req: Json, *, background: bool, tag: str | None) -> None:
        self.pid = spawned.pid
        self.tag = tag
        self.background = background
        self.req = req
        self.started_at = time.time()
        self.stdin = spawned.stdin
        self.master = spawned.master
        self._spawned = spawned
        self.ring = OutputRing(OUTPUT_RING if background else 0)
        self.listeners: list[Listener] = []
        self.output_lock = asyncio.Lock()
        self.exited = asyncio.Event()  # the process is gone (its output may still be read)
        self.done = asyncio.Event()  # and all of it was read: `result` is there
        self.result: Json = {}
        self.max_output: int | None = None  # bytes per stream; past it the process is killed
        self.truncated = False
        self._task: asyncio.Future[None] | None = None

    def start(
        self,
        status: asyncio.Future[int],
        timeout: float | None,
        on_done: Callable[[Process], None],
    ) -> None:
        """Reads its output until it ends; `status` is its exit status from the reaper."""
        self._task = asyncio.ensure_future(self._run(status, timeout))
        self._task.add_done_callback(lambda _: on_done(self))

    def info(self) -> Json:
        req = self.req
        command: Json = {"cmd": req["cmd"]} if "cmd" in req else {"argv": req["argv"]}
        return {
            "pid": self.pid,
            "tag": self.tag,
            **command,
            "cwd": self.req.get("cwd"),
            "pty": self.master is not None,
            "background": self.background,
            "started_at": self.started_at,
            # Ended only once its result is there: its exit is seen before the last of its
            # output is read, and "ended" with no exit code would be read as killed.
            "running": not self.done.is_set(),
            "exit_code": self.result.get("exit_code"),
            "signal": self.result.get("signal"),
        }

    # --- input and signals -------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.stdin is None:
            raise OpError(p.ErrorCode.INVALID, f"process {self.pid} was started without stdin")
        try:
            self.stdin.write(data)
        except OpError:
            self.signal(signal.SIGKILL)
            raise

    def close_stdin(self) -> None:
        if self.stdin is None:
            return
        if self.master is not None:
            self.stdin.write(b"\x04")  # a terminal's end of input is ^D
        else:
            self.stdin.close()

    def signal(self, signum: int) -> None:
        if self.exited.is_set():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(self.pid, signum)

    def resize(self, rows: int, cols: int) -> None:
        if self.master is None:
            raise OpError(p.ErrorCode.INVALID, f"process {self.pid} has no terminal to resize")
        with contextlib.suppress(OSError, struct.error):
            set_winsize(self.master, rows, cols)

    def on_frame(self, ftype: p.FrameType, payload: bytes) -> Json | None:
        """A frame from a channel that follows this process; a control message is returned."""
        if ftype == p.FrameType.STDIN and self.stdin is not None:
            with contextlib.suppress(OpError):  # an overflow killed it: its end says so
                self.write(payload)
        elif ftype == p.FrameType.END:
            self.close_stdin()
        elif ftype == p.FrameType.CONTROL:
            try:
                ctl = p.decode_json(payload)
            except p.ProtocolError:
                return None
            if isinstance(ctl.get("signal"), int):
                self.signal(ctl["signal"])
            resize = ctl.get("resize")
            if self.master is not None and isinstance(resize, list) and len(resize) == 2:
                with contextlib.suppress(OpError, ValueError, TypeError):
                    self.resize(int(resize[0]), int(resize[1]))
            return ctl
        return None

    # --- output ------------------------------------------------------------------------------

    async def _emit(self, ftype: p.FrameType, data: bytes) -> None:
        async with self.output_lock:
            self.ring.add(ftype, data)
            for listener in list(self.listeners):
                if listener.conn.alive:
                    await listener.conn.send(ftype, listener.channel, data)
                else:
                    self.listeners.remove(listener)

    async def _pump(self, fd: int, ftype: p.FrameType) -> None:
        os.set_blocking(fd, False)
        room = self.max_output
        try:
            while True:
                try:
                    data = os.read(fd, p.CHUNK_SIZE)
                except BlockingIOError:
                    if self.exited.is_set():
                        return  # the process is gone and everything it wrote has been read
                    await wait_readable(fd, self.exited)
                    continue
                except OSError:  # EIO: the pty's other side closed
                    return
                if not data:
                    return
                if room is not None:
                    if len(data) > room:
                        # Cut off at the cap (what it writes meanwhile is read and dropped).
                        data = data[:room]
                        if not self.truncated:
                            self.truncated = True
                            self.signal(signal.SIGKILL)
                    room -= len(data)
                if data:
                    await self._emit(ftype, data)
                if len(data) < p.CHUNK_SIZE and fd != self.master:  # a terminal is read live
                    await gather_more(self.exited)
        finally:
            os.close(fd)

    async def _run(self, exit_status: asyncio.Future[int], timeout: float | None) -> None:
        started = time.monotonic()
        pumps = [asyncio.ensure_future(self._pump(fd, ft)) for fd, ft in self._spawned.pumps]
        timed_out = False
        try:
            status = await asyncio.wait_for(asyncio.shield(exit_status), timeout)
        except TimeoutError:
            timed_out = True
            self.signal(signal.SIGKILL)
            status = await exit_status
        if self._spawned.proc is not None:
            self._spawned.proc.returncode = os.waitstatus_to_exitcode(status)
        self.exited.set()
        await asyncio.gather(*pumps)
        if self.stdin is not None:
            self.stdin.abort()
        self.result = {
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out,
            "truncated": self.truncated,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        self.done.set()

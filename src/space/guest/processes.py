"""Processes in the guest: spawning, streaming their output, feeding stdin, reaping."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pwd
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import protocol as p
from .common import Json, OpError, os_error, str_arg
from .system import DEFAULT_PATH

if TYPE_CHECKING:
    from .agent import Agent, Connection, Inbox

STDIN_BUFFER_LIMIT = 64 << 20


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


class FdWriter:
    """Non-blocking writes to a pipe or pty with a buffer; `close()` once drained."""

    def __init__(self, fd: int, on_error: Callable[[], None]) -> None:
        self.fd = fd
        self._buf = bytearray()
        self._closing = False
        self._closed = False
        self._on_error = on_error
        os.set_blocking(fd, False)

    def write(self, data: bytes) -> None:
        if self._closed or self._closing:
            return
        if len(self._buf) + len(data) > STDIN_BUFFER_LIMIT:
            raise OpError(p.ErrorCode.INVALID, "stdin buffer overflow: the process reads no input")
        was_empty = not self._buf
        self._buf += data
        if was_empty:
            self._flush()

    def close(self) -> None:
        self._closing = True
        if not self._buf:
            self._close_now()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            n = os.write(self.fd, self._buf)
            del self._buf[:n]
        except BlockingIOError:
            pass
        except OSError:  # the reader went away: what is left can never be delivered
            self._buf.clear()
            self._on_error()
            self._close_now()
            return
        if self._buf:
            loop.add_writer(self.fd, self._on_writable)
        elif self._closing:
            self._close_now()

    def _on_writable(self) -> None:
        asyncio.get_running_loop().remove_writer(self.fd)
        self._flush()

    def abort(self) -> None:
        self._buf.clear()
        self._close_now()

    def _close_now(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_writer(self.fd)
            os.close(self.fd)


class ExecOp:
    """One process: spawn, stream its output, feed its input, signal it, report how it ended."""

    def __init__(self, agent: Agent, conn: Connection, channel: int, req: Json) -> None:
        self.agent = agent
        self.conn = conn
        self.channel = channel
        self.req = req
        self.exited = asyncio.Event()
        self.stdin: FdWriter | None = None
        self.master: int | None = None
        self.pid = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self.max_output: int | None = None  # bytes per stream; past it the process is killed
        self.truncated = False

    def _argv(self) -> list[str]:
        if "cmd" in self.req:
            return ["/bin/sh", "-c", str_arg(self.req, "cmd")]
        argv = self.req.get("argv")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise OpError(p.ErrorCode.INVALID, "give 'argv' (a non-empty list of strings) or 'cmd'")
        return argv

    def _env_and_user(self) -> tuple[dict[str, str], pwd.struct_passwd | None]:
        user = self.req.get("user")
        entry = None
        env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/root", "USER": "root"}
        if user is not None:
            try:
                entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(str(user))
            except KeyError:
                raise OpError(p.ErrorCode.NOT_FOUND, f"no such user: {user}") from None
            env.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)
        if self.req.get("pty"):
            env["TERM"] = "xterm-256color"
        extra = self.req.get("env") or {}
        if not isinstance(extra, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k
            for k, v in extra.items()
        ):
            raise OpError(p.ErrorCode.INVALID, "'env' must map variable names to strings")
        env.update(extra)
        return env, entry

    def _spawn(self) -> list[tuple[int, p.FrameType]]:
        argv = self._argv()
        env, entry = self._env_and_user()
        cwd = self.req.get("cwd") or (entry.pw_dir if entry else "/")
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise OpError(p.ErrorCode.NOT_FOUND, f"working directory does not exist: {cwd}")
        user_kw: dict[str, Any] = {}
        if entry is not None and entry.pw_uid != os.getuid():
            user_kw = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        wants_stdin = bool(self.req.get("stdin"))
        child_fds: list[int] = []
        try:
            if self.req.get("pty"):
                master, slave = os.openpty()
                self.master = master
                child_fds.append(slave)
                rows, cols = self.req.get("rows", 24), self.req.get("cols", 80)
                _set_winsize(slave, rows, cols)
                stdio: tuple[int, int, int] = (slave, slave, slave)
                pumps = [(master, p.FrameType.STDOUT)]
                preexec: Callable[[], None] | None = _take_controlling_tty
            else:
                out_r, out_w = os.pipe2(os.O_CLOEXEC)
                err_r, err_w = os.pipe2(os.O_CLOEXEC)
                child_fds += [out_w, err_w]
                if wants_stdin:
                    in_r, in_w = os.pipe2(os.O_CLOEXEC)
                    child_fds.append(in_r)
                    self.stdin = FdWriter(in_w, lambda: None)
                    stdin_fd = in_r
                else:
                    stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                    child_fds.append(stdin_fd)
                stdio = (stdin_fd, out_w, err_w)
                pumps = [(out_r, p.FrameType.STDOUT), (err_r, p.FrameType.STDERR)]
                preexec = None
            try:
                same_path = env.get("PATH") == os.environ.get("PATH")  # posix_spawnp looks in ours
                if preexec is None and not user_kw and same_path and os.path.samefile(cwd, "."):
                    # The common case in one C call: far less Python to run (and, under
                    # emulation, to translate) than subprocess.Popen.
                    self.pid = os.posix_spawnp(
                        argv[0],
                        argv,
                        env,
                        file_actions=[(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(stdio)],
                        setsid=True,
                    )
                else:
                    proc = subprocess.Popen(
                        argv,
                        stdin=stdio[0],
                        stdout=stdio[1],
                        stderr=stdio[2],
                        cwd=cwd,
                        env=env,
                        start_new_session=True,
                        preexec_fn=preexec,
                        **user_kw,
                    )
                    self.pid = proc.pid
                    self._proc = proc  # held so Popen never reaps the child itself
            except OSError as e:
                for fd, _ in pumps:
                    os.close(fd)
                if self.stdin is not None:
                    self.stdin.abort()
                if isinstance(e, FileNotFoundError):
                    missing = f"executable not found: {argv[0]}"
                    raise OpError(p.ErrorCode.NOT_FOUND, missing) from None
                raise os_error(e, argv[0]) from None
        finally:
            for fd in child_fds:
                os.close(fd)
        if self.master is not None:
            self.stdin = FdWriter(os.dup(self.master), lambda: None)
        return pumps

    async def _feed(self, inbox: Inbox) -> None:
        while True:
            self.on_frame(*await inbox.get())

    def on_frame(self, ftype: p.FrameType, payload: bytes) -> None:
        if ftype == p.FrameType.STDIN and self.stdin is not None:
            try:
                self.stdin.write(payload)
            except OpError:
                self.signal(signal.SIGKILL)
        elif ftype == p.FrameType.END and self.stdin is not None:
            if self.master is not None:
                self.stdin.write(b"\x04")  # a terminal's end of input is ^D
            else:
                self.stdin.close()
        elif ftype == p.FrameType.CONTROL:
            try:
                ctl = p.decode_json(payload)
            except p.ProtocolError:
                return
            if isinstance(ctl.get("signal"), int):
                self.signal(ctl["signal"])
            resize = ctl.get("resize")
            if self.master is not None and isinstance(resize, list) and len(resize) == 2:
                with contextlib.suppress(OSError, struct.error):
                    _set_winsize(self.master, int(resize[0]), int(resize[1]))

    def signal(self, signum: int) -> None:
        if self.exited.is_set() or not self.pid:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError, ValueError):
            os.killpg(self.pid, signum)

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
                    await self.conn.send(ftype, self.channel, data)
        finally:
            os.close(fd)

    async def run(self) -> Json:
        timeout = self.req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise OpError(p.ErrorCode.INVALID, "'timeout' must be a positive number of seconds")
        max_output = self.req.get("max_output")
        if max_output is not None and (
            not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 0
        ):
            raise OpError(p.ErrorCode.INVALID, "'max_output' must be a number of bytes")
        self.max_output = max_output
        started = time.monotonic()
        pumps = self._spawn()
        exit_status = self.agent.reaper.watch(self.pid)
        await self.conn.send_json(p.FrameType.EVENT, self.channel, {"pid": self.pid})
        feeder = asyncio.ensure_future(self._feed(self.conn.inboxes[self.channel]))
        pump_tasks = [asyncio.ensure_future(self._pump(fd, ft)) for fd, ft in pumps]
        timed_out = False
        try:
            status = await asyncio.wait_for(asyncio.shield(exit_status), timeout)
        except TimeoutError:
            timed_out = True
            self.signal(signal.SIGKILL)
            status = await exit_status
        if self._proc is not None:
            self._proc.returncode = os.waitstatus_to_exitcode(status)
        self.exited.set()
        await asyncio.gather(*pump_tasks)
        feeder.cancel()
        if self.stdin is not None:
            self.stdin.abort()
        result: Json = {
            "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "timed_out": timed_out,
            "truncated": self.truncated,
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        return result


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)

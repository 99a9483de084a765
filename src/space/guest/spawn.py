"""Starting a process in the guest: its argv, environment, user and directory, its pipes or
pseudo-terminal; and the non-blocking writer that feeds its input."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pwd
import struct
import subprocess
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import protocol as p
from . import reserve
from .common import Json, OpError, os_error, str_arg
from .system import DEFAULT_PATH

STDIN_BUFFER_LIMIT = 64 << 20


class FdWriter:
    """Non-blocking writes to a pipe or pty with a buffer; `close()` once drained."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()
        self._closing = False
        self._closed = False
        self.written = 0  # bytes the process has (in its pipe)
        self._progress = asyncio.Event()
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

    @property
    def taken(self) -> int:
        """Bytes accepted by `write` (those dropped with the process's end aside)."""
        return self.written + len(self._buf)

    @property
    def closed(self) -> bool:
        return self._closed

    async def reached(self, offset: int) -> None:
        """Once the first `offset` bytes taken are written (or never will be: closed)."""
        while self.written < offset and not self._closed:
            self._progress.clear()
            await self._progress.wait()

    def close(self) -> None:
        self._closing = True
        if not self._buf:
            self._close_now()

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            n = os.write(self.fd, self._buf)
            del self._buf[:n]
            self.written += n
            self._progress.set()
        except BlockingIOError:
            pass
        except OSError:  # the reader went away: what is left can never be delivered
            self._buf.clear()
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
            self._progress.set()
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_writer(self.fd)
            os.close(self.fd)


@dataclass
class Spawned:
    pid: int
    pumps: list[tuple[int, p.FrameType]]  # the fds its output is read from, and as what
    stdin: FdWriter | None  # None: its stdin is /dev/null
    master: int | None  # its pty, if it has one
    proc: subprocess.Popen[bytes] | None  # held so Popen never reaps the child itself


def argv_of(req: Json) -> list[str]:
    if "cmd" in req:
        return ["/bin/sh", "-c", str_arg(req, "cmd")]
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise OpError(p.ErrorCode.INVALID, "give 'argv' (a non-empty list of strings) or 'cmd'")
    return argv


def _env_and_user(req: Json) -> tuple[dict[str, str], pwd.struct_passwd | None]:
    user = req.get("user")
    entry = None
    env = {"PATH": DEFAULT_PATH, "LANG": "C.UTF-8", "HOME": "/root", "USER": "root"}
    if user is not None:
        try:
            entry = pwd.getpwuid(user) if isinstance(user, int) else pwd.getpwnam(str(user))
        except KeyError:
            raise OpError(p.ErrorCode.NOT_FOUND, f"no such user: {user}") from None
        env.update(HOME=entry.pw_dir, USER=entry.pw_name, LOGNAME=entry.pw_name)
    if req.get("pty"):
        env["TERM"] = "xterm-256color"
    extra = req.get("env") or {}
    if not isinstance(extra, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and k and "=" not in k for k, v in extra.items()
    ):
        raise OpError(p.ErrorCode.INVALID, "'env' must map variable names to strings")
    env.update(extra)
    return env, entry


def spawn(req: Json) -> Spawned:
    """Starts the process an exec request asks for, in a session of its own."""
    argv = argv_of(req)
    env, entry = _env_and_user(req)
    cwd = req.get("cwd") or (entry.pw_dir if entry else "/")
    if not isinstance(cwd, str) or not os.path.isdir(cwd):
        raise OpError(p.ErrorCode.NOT_FOUND, f"working directory does not exist: {cwd}")
    user_kw: dict[str, Any] = {}
    if entry is not None and entry.pw_uid != os.getuid():
        user_kw = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    stdin: FdWriter | None = None
    master: int | None = None
    child_fds: list[int] = []
    try:
        if req.get("pty"):
            master, slave = os.openpty()
            child_fds.append(slave)
            set_winsize(slave, req.get("rows", 24), req.get("cols", 80))
            stdio: tuple[int, int, int] = (slave, slave, slave)
            pumps = [(master, p.FrameType.STDOUT)]
            preexec: Callable[[], None] | None = _take_controlling_tty
        else:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            with contextlib.suppress(OSError):  # a bigger burst per read of its output
                fcntl.fcntl(out_r, fcntl.F_SETPIPE_SZ, p.CHUNK_SIZE)
            child_fds += [out_w, err_w]
            if req.get("stdin"):
                in_r, in_w = os.pipe2(os.O_CLOEXEC)
                child_fds.append(in_r)
                stdin = FdWriter(in_w)
                stdin_fd = in_r
            else:
                stdin_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                child_fds.append(stdin_fd)
            stdio = (stdin_fd, out_w, err_w)
            pumps = [(out_r, p.FrameType.STDOUT), (err_r, p.FrameType.STDERR)]
            preexec = None
        try:
            with reserve.tenant():
                pid, proc = _start(argv, env, cwd, stdio, preexec, user_kw)
        except OSError as e:
            for fd, _ in pumps:
                os.close(fd)
            if stdin is not None:
                stdin.abort()
            if isinstance(e, FileNotFoundError):
                raise OpError(p.ErrorCode.NOT_FOUND, f"executable not found: {argv[0]}") from None
            raise os_error(e, argv[0]) from None
    finally:
        for fd in child_fds:
            os.close(fd)
    if master is not None:
        stdin = FdWriter(os.dup(master))
    return Spawned(pid, pumps, stdin, master, proc)


def _start(
    argv: list[str],
    env: dict[str, str],
    cwd: str,
    stdio: tuple[int, int, int],
    preexec: Callable[[], None] | None,
    user_kw: dict[str, Any],
) -> tuple[int, subprocess.Popen[bytes] | None]:
    same_path = env.get("PATH") == os.environ.get("PATH")  # posix_spawnp looks in ours
    if preexec is None and not user_kw and same_path and os.path.samefile(cwd, "."):
        # The common case in one C call: far less Python to run (and, under emulation, to
        # translate) than subprocess.Popen.
        actions = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(stdio)]
        return os.posix_spawnp(argv[0], argv, env, file_actions=actions, setsid=True), None
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
    return proc.pid, proc


def set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)

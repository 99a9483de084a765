"""The guest agent: PID 1 of every SPACE VM (standard library only).

It sets up the little a VM needs before user code runs (pseudo-terminals, hostname, loopback),
reaps orphans like any init, and serves the host over one byte stream (see `protocol`): it runs
processes and streams their output, moves files in and out, and after a snapshot restore takes
a fresh identity (clock, RNG, hostname, token) from the host.

The stream is a virtio-serial port named `space.agent` under QEMU, or vsock port 1024 under
Firecracker; `--listen-unix PATH` serves a unix socket instead (used to test the agent on a host).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import errno
import fcntl
import hmac
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from . import protocol as p

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_POLL_S = 0.5  # a disconnected virtio port is checked this often even without a SIGIO
STDIN_BUFFER_LIMIT = 64 << 20
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

Json = dict[str, Any]


def log(msg: str) -> None:
    print(f"space-agent: {msg}", file=sys.stderr, flush=True)


class OpError(Exception):
    """An operation failed in a way the host should be told about."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def os_error(e: OSError, path: str) -> OpError:
    codes = {
        errno.ENOENT: p.ErrorCode.NOT_FOUND,
        errno.EEXIST: p.ErrorCode.EXISTS,
        errno.ENOTDIR: p.ErrorCode.NOT_A_DIRECTORY,
        errno.EISDIR: p.ErrorCode.IS_A_DIRECTORY,
        errno.ENOTEMPTY: p.ErrorCode.NOT_EMPTY,
        errno.EACCES: p.ErrorCode.PERMISSION_DENIED,
        errno.EPERM: p.ErrorCode.PERMISSION_DENIED,
        errno.ENOSPC: p.ErrorCode.NO_SPACE,
        errno.EDQUOT: p.ErrorCode.NO_SPACE,
    }
    code = codes.get(e.errno or 0, p.ErrorCode.INTERNAL)
    return OpError(code, f"{path}: {e.strerror or e}")


# --- the VM's init duties -------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str, options: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), 0, options.encode()) != 0:
        err = ctypes.get_errno()
        if err != errno.EBUSY:
            log(f"mount {fstype} on {target}: {os.strerror(err)}")


def kernel_args() -> dict[str, str]:
    try:
        words = Path("/proc/cmdline").read_text().split()
    except OSError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def interface_up(name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", name.encode(), 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", name.encode(), flags | IFF_UP))


def init_system(args: dict[str, str]) -> None:
    """What a minimal init does before anything else runs."""
    os.environ.clear()
    os.environ.update({"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
    _mount("devpts", "/dev/pts", "devpts", "gid=5,mode=620,ptmxmode=666")
    _mount("tmpfs", "/dev/shm", "tmpfs", "mode=1777")
    os.makedirs("/tmp", mode=0o1777, exist_ok=True)
    socket.sethostname(args.get("space.hostname", "space"))
    try:
        interface_up("lo")
    except OSError as e:
        log(f"loopback: {e}")


def add_entropy(seed: bytes) -> None:
    """Mix host entropy into the kernel RNG and force a reseed so clones diverge at once."""
    with open("/dev/urandom", "wb") as f:
        info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
        fcntl.ioctl(f.fileno(), RNDADDENTROPY, info)
        with contextlib.suppress(OSError):  # older kernels lack it; the add already reseeds
            fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)


# --- child processes ------------------------------------------------------------------------


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


# --- one host connection --------------------------------------------------------------------

Inbox = asyncio.Queue[tuple[p.FrameType, bytes]]


class Connection:
    """Serves one host connection: authentication, then concurrent operations on channels."""

    def __init__(
        self, agent: Agent, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.agent = agent
        self.reader = reader
        self.writer = writer
        self.alive = True
        self.authenticated = False
        # Frames for an open channel wait here until its operation takes them, so that data
        # sent right behind a REQUEST is never lost.
        self.inboxes: dict[int, Inbox] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    async def _write(self, frame: bytes) -> None:
        if not self.alive:
            return
        try:
            self.writer.write(frame)
            await self.writer.drain()
        except (ConnectionError, OSError, RuntimeError):
            self.alive = False

    async def send(self, ftype: p.FrameType, channel: int, payload: bytes = b"") -> None:
        await self._write(p.encode(ftype, channel, payload))

    async def send_json(self, ftype: p.FrameType, channel: int, obj: Json) -> None:
        await self._write(p.encode_json(ftype, channel, obj))

    async def serve(self) -> None:
        decoder = p.FrameDecoder()
        try:
            while True:
                data = await self.reader.read(p.CHUNK_SIZE)
                if not data:
                    return
                for ftype, channel, payload in decoder.feed(data):
                    await self._dispatch(ftype, channel, payload)
        except (ConnectionError, OSError):
            return
        finally:
            # Operations in flight keep running (processes are not killed because the host went
            # away, e.g. for a snapshot); what they would send is dropped.
            self.alive = False
            self.inboxes.clear()

    async def _dispatch(self, ftype: p.FrameType, channel: int, payload: bytes) -> None:
        if ftype == p.FrameType.HELLO:
            await self._hello(payload)
        elif not self.authenticated:
            return  # nothing but HELLO is heard before authentication
        elif ftype == p.FrameType.REQUEST:
            if channel in self.inboxes:
                await self.send_json(
                    p.FrameType.REPLY,
                    channel,
                    p.error_body(p.ErrorCode.INVALID, f"channel {channel} is already open"),
                )
                return
            self.inboxes[channel] = asyncio.Queue()
            task = asyncio.ensure_future(self._run_op(channel, payload))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        else:
            inbox = self.inboxes.get(channel)
            if inbox is not None:
                inbox.put_nowait((ftype, payload))

    async def _hello(self, payload: bytes) -> None:
        try:
            hello = p.decode_json(payload)
        except p.ProtocolError:
            return
        token = str(hello.get("token", ""))
        nonce = str(hello.get("nonce", ""))
        expected = self.agent.token
        accepted = bool(expected) and hmac.compare_digest(token.encode(), expected.encode())
        if not accepted:
            log("rejected a connection with a wrong token")
        self.authenticated = accepted
        self.inboxes.clear()
        await self._write(p.welcome_frame(nonce, accepted))

    async def _run_op(self, channel: int, payload: bytes) -> None:
        try:
            req = p.decode_json(payload)
            op = req.get("op")
            handler = self.agent.ops.get(op) if isinstance(op, str) else None
            if handler is None:
                raise OpError(p.ErrorCode.INVALID, f"unknown operation {op!r}")
            result = await handler(self, channel, req)
        except OpError as e:
            result = p.error_body(e.code, e.message)
        except p.ProtocolError as e:
            result = p.error_body(p.ErrorCode.INVALID, str(e))
        except Exception as e:
            log(f"operation failed: {e!r}")
            result = p.error_body(p.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self.inboxes.pop(channel, None)
        await self.send_json(p.FrameType.REPLY, channel, result)


# --- operations -----------------------------------------------------------------------------


def _str_arg(req: Json, key: str, required: bool = True, default: str = "") -> str:
    value = req.get(key, default)
    if (required and key not in req) or not isinstance(value, str):
        raise OpError(p.ErrorCode.INVALID, f"{key!r} must be a string")
    return value


def _path_arg(req: Json) -> str:
    path = _str_arg(req, "path")
    if not path.startswith("/"):
        raise OpError(p.ErrorCode.INVALID, f"path must be absolute, got {path!r}")
    if "\0" in path:
        raise OpError(p.ErrorCode.INVALID, "path contains a NUL byte")
    return path


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

    def _argv(self) -> list[str]:
        if "cmd" in self.req:
            return ["/bin/sh", "-c", _str_arg(self.req, "cmd")]
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
                await self.conn.send(ftype, self.channel, data)
        finally:
            os.close(fd)

    async def run(self) -> Json:
        timeout = self.req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise OpError(p.ErrorCode.INVALID, "'timeout' must be a positive number of seconds")
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
            "duration_ms": round((time.monotonic() - started) * 1000, 3),
        }
        return result


def _set_winsize(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _take_controlling_tty() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _stat_entry(path: str, name: str | None = None) -> Json:
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


class Agent:
    def __init__(self, token: str, system: bool) -> None:
        self.token = token
        self.system = system  # True when this is a VM's init and may change the machine
        self.boot_id = _boot_id()
        self.reaper: Reaper
        self.ops: dict[str, Callable[[Connection, int, Json], Awaitable[Json]]] = {
            "ping": self.op_ping,
            "info": self.op_info,
            "exec": self.op_exec,
            "read_file": self.op_read_file,
            "write_file": self.op_write_file,
            "list_dir": self.op_list_dir,
            "stat": self.op_stat,
            "remove": self.op_remove,
            "mkdir": self.op_mkdir,
            "identity": self.op_identity,
            "shutdown": self.op_shutdown,
        }

    async def op_ping(self, conn: Connection, channel: int, req: Json) -> Json:
        return {}

    async def op_info(self, conn: Connection, channel: int, req: Json) -> Json:
        u = os.uname()
        return {
            "kernel": u.release,
            "hostname": socket.gethostname(),
            "boot_id": self.boot_id,
            "time_ns": time.time_ns(),
            "uptime_s": time.clock_gettime(time.CLOCK_BOOTTIME),
            "agent_pid": os.getpid(),
        }

    async def op_exec(self, conn: Connection, channel: int, req: Json) -> Json:
        return await ExecOp(self, conn, channel, req).run()

    async def op_read_file(self, conn: Connection, channel: int, req: Json) -> Json:
        path = _path_arg(req)
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

    async def op_write_file(self, conn: Connection, channel: int, req: Json) -> Json:
        """Streams DATA frames into a temporary file renamed over `path` at END: all or nothing."""
        path = _path_arg(req)
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
        await conn.send_json(p.FrameType.EVENT, channel, {"ready": True})
        written = 0
        failure: OpError | None = None
        try:
            while True:
                ftype, data = await queue.get()
                if ftype == p.FrameType.END:
                    break
                if ftype != p.FrameType.DATA or failure is not None:
                    continue  # after a failure, drain the host's data until its END
                try:
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    written += len(data)
                except OSError as e:
                    failure = os_error(e, path)
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

    async def op_list_dir(self, conn: Connection, channel: int, req: Json) -> Json:
        path = _path_arg(req)
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise os_error(e, path) from None
        entries = []
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # removed while we looked
                entries.append(_stat_entry(os.path.join(path, name), name))
        return {"entries": entries}

    async def op_stat(self, conn: Connection, channel: int, req: Json) -> Json:
        path = _path_arg(req)
        try:
            return _stat_entry(path)
        except OSError as e:
            raise os_error(e, path) from None

    async def op_remove(self, conn: Connection, channel: int, req: Json) -> Json:
        path = _path_arg(req)
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

    async def op_mkdir(self, conn: Connection, channel: int, req: Json) -> Json:
        path = _path_arg(req)
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
        return _stat_entry(path)

    async def op_identity(self, conn: Connection, channel: int, req: Json) -> Json:
        """After a restore: the host's clock, fresh entropy, a new hostname and token."""
        if not self.system:
            raise OpError(p.ErrorCode.INVALID, "identity can only change inside a VM")
        if "time_ns" in req:
            time.clock_settime_ns(time.CLOCK_REALTIME, int(req["time_ns"]))
        if "entropy" in req:
            try:
                seed = base64.b64decode(_str_arg(req, "entropy"), validate=True)
            except ValueError:
                raise OpError(p.ErrorCode.INVALID, "'entropy' must be base64") from None
            add_entropy(seed)
        if "hostname" in req:
            socket.sethostname(_str_arg(req, "hostname"))
        if "token" in req:
            token = _str_arg(req, "token")
            if len(token) < 16:
                raise OpError(p.ErrorCode.INVALID, "a token needs at least 16 characters")
            self.token = token  # checked at the next HELLO; this connection stays open
        return {"hostname": socket.gethostname(), "time_ns": time.time_ns()}

    async def op_shutdown(self, conn: Connection, channel: int, req: Json) -> Json:
        if not self.system:
            raise OpError(p.ErrorCode.INVALID, "shutdown only applies inside a VM")
        os.sync()
        asyncio.get_running_loop().call_later(0.05, _power_off)
        return {}

    # --- transports --------------------------------------------------------------------------

    async def serve_stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = Connection(self, reader, writer)
        try:
            await conn.serve()
        finally:
            writer.close()

    async def serve_port(self, device: str) -> None:
        """A virtio-serial port: one host connection at a time, reattached when the host returns."""
        loop = asyncio.get_running_loop()
        fd = os.open(device, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        # A port whose host side is closed polls as hung up, and poll() gives no wake-up when
        # the host connects; the port's SIGIO does (set only while waiting: it also fires for
        # every piece of data).
        host_changed = asyncio.Event()
        loop.add_signal_handler(signal.SIGIO, host_changed.set)
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        log(f"serving on {device}")
        while True:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC)
            while any(ev & select.POLLHUP for _, ev in poller.poll(0)):
                host_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(host_changed.wait(), HOST_POLL_S)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
            reader = asyncio.StreamReader(limit=p.MAX_PAYLOAD * 4)
            rtrans, _ = await loop.connect_read_pipe(
                lambda r=reader: asyncio.StreamReaderProtocol(r),  # type: ignore[misc]
                os.fdopen(os.dup(fd), "rb", buffering=0),
            )
            wtrans, wproto = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                os.fdopen(os.dup(fd), "wb", buffering=0),
            )
            writer = asyncio.StreamWriter(wtrans, wproto, None, loop)
            try:
                await Connection(self, reader, writer).serve()
            finally:
                rtrans.close()
                wtrans.abort()

    async def serve_vsock(self, port: int) -> None:
        sock = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
        sock.bind((socket.VMADDR_CID_ANY, port))
        server = await asyncio.start_server(self.serve_stream, sock=sock)
        log(f"serving on vsock port {port}")
        await server.serve_forever()

    async def serve_unix(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        server = await asyncio.start_unix_server(self.serve_stream, path)
        os.chmod(path, 0o600)
        await server.serve_forever()

    async def run(self, listen_unix: str | None) -> None:
        self.reaper = Reaper(asyncio.get_running_loop())
        if listen_unix:
            await self.serve_unix(listen_unix)
            return
        port = find_agent_port()
        if port is not None:
            await self.serve_port(port)
        else:
            await self.serve_vsock(p.AGENT_VSOCK_PORT)


def find_agent_port() -> str | None:
    for name_file in Path("/sys/class/virtio-ports").glob("*/name"):
        with contextlib.suppress(OSError):
            if name_file.read_text().strip() == p.AGENT_PORT_NAME:
                return f"/dev/{name_file.parent.name}"
    return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _power_off() -> None:
    _libc.reboot(0x4321FEDC)  # LINUX_REBOOT_CMD_POWER_OFF


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="space-agent", description=__doc__)
    parser.add_argument("--listen-unix", help="serve a unix socket (testing on a host)")
    parser.add_argument("--token-file", help="read the token from this file, not the kernel")
    args = parser.parse_args(argv)
    system = os.getpid() == 1
    kargs = kernel_args() if system else {}
    if system:
        init_system(kargs)
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    else:
        token = kargs.get("space.token", "")
    if not token:
        log("no token given: every connection will be refused")
    agent = Agent(token, system)
    log(f"ready (kernel {os.uname().release})")
    try:
        asyncio.run(agent.run(args.listen_unix))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

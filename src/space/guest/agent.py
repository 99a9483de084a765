"""The guest agent: PID 1 of every SPACE VM (standard library only).

It sets up the little a VM needs before user code runs (pseudo-terminals, hostname, loopback),
reaps orphans like any init, and serves the host over one byte stream (see `protocol`): it runs
processes and streams their output, moves files in and out, after a snapshot restore takes a
fresh identity (clock, RNG, hostname, token) from the host, and does the platform's own duties
in the guest with system calls of its own (`storage`: flush, volumes, root size; `trust`: the
gateway's CA; `tcp`: connections to guest ports for ingress), so the host never has to run a
program of the guest's, which the tenant (root in there) may have replaced.

Its modules are all imported at start, before any user code runs: its sources live in /run/space
and the standard library on the guest's disk, both the tenant's to change later (so the host
holds even the agent to its limits: see `protocol`).

The stream is a virtio-serial port named `space.agent` under QEMU, or vsock port 1024 under
Firecracker; `--listen-unix PATH` serves a unix socket instead (used to test the agent on a host).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import fcntl
import hmac
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from . import files, reserve, storage, system, tcp, trust, watch
from . import protocol as p
from .common import Json, OpError, log, str_arg
from .process_table import ProcessOps, ProcessTable
from .processes import Reaper

Inbox = asyncio.Queue[tuple[p.FrameType, bytes]]
Op = Callable[["Connection", int, Json], Awaitable[Json]]

HOST_POLL_S = 0.5  # a disconnected virtio port is checked this often even without a SIGIO
HOST_LEFT = "the host left the agent's port"


class Reader(Protocol):
    async def read_parts(self, n: int) -> list[bytes]:
        """Up to about `n` bytes that came from the host, at least one; none once it left."""
        ...


class StreamParts:
    """A stream's reader as a `Reader` (vsock, a unix socket)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def read_parts(self, n: int) -> list[bytes]:
        data = await self.reader.read(n)
        return [data] if data else []


class PortReader:
    """The host's bytes from a virtio-serial port (non-blocking). A read(2) there gives at most
    one of the port's 4 KiB buffers, and a trip round the event loop per buffer bounded what the
    host could send to ~10 MB/s under TCG: each wake-up takes all the buffers there are, up to
    what was asked, in one go."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    async def read_parts(self, n: int) -> list[bytes]:
        """The buffers there are, up to `n` bytes (unjoined: the decoder copies once)."""
        while True:
            parts: list[bytes] = []
            size = 0
            while size < n:
                try:
                    part = os.read(self.fd, n - size)
                except BlockingIOError:
                    break
                if not part:  # the host closed its side
                    return parts
                parts.append(part)
                size += len(part)
            if parts:
                return parts
            await self._readable()

    async def _readable(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(self.fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(self.fd)


# --- one host connection --------------------------------------------------------------------


class Connection:
    """Serves one host connection: authentication, then concurrent operations on channels."""

    def __init__(self, agent: Agent, reader: Reader, writer: asyncio.StreamWriter) -> None:
        self.agent = agent
        self.reader = reader
        self.writer = writer
        self.alive = True
        self.authenticated = False
        # Frames for an open channel wait here until its operation takes them, so that data
        # sent right behind a REQUEST is never lost.
        self.inboxes: dict[int, Inbox] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.gone = asyncio.Event()  # the host went away: relays for it end

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
                parts = await self.reader.read_parts(p.CHUNK_SIZE)
                if not parts:
                    return
                for data in parts:
                    for ftype, channel, payload in decoder.feed(data):
                        await self._dispatch(ftype, channel, payload)
        except (ConnectionError, OSError):
            return
        finally:
            # Operations in flight keep running (processes are not killed because the host went
            # away, e.g. for a snapshot); what they would send is dropped.
            self.alive = False
            self.gone.set()
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
        reply = p.encode_json(p.FrameType.REPLY, channel, result)
        if len(reply) - p.HEADER_SIZE > p.MAX_JSON:  # the host would refuse it
            too_big = f"the reply would be {len(reply)} bytes, more than {p.MAX_JSON}"
            body = p.error_body(p.ErrorCode.INTERNAL, too_big)
            reply = p.encode_json(p.FrameType.REPLY, channel, body)
        await self._write(reply)


class Agent:
    def __init__(self, token: str, in_vm: bool) -> None:
        self.token = token
        self.in_vm = in_vm  # this is a VM's init, which may change the machine
        self.boot_id = system.boot_id()
        self.processes = ProcessTable()
        procs = ProcessOps(self.processes)
        self.ops: dict[str, Op] = {
            "ping": self.op_ping,
            "info": self.op_info,
            "exec": procs.exec,
            "attach": procs.attach,
            "processes": procs.processes,
            "control": procs.control,
            "read_file": files.read_file,
            "write_file": files.write_file,
            "list_dir": files.list_dir,
            "stat": files.stat_path,
            "remove": files.remove,
            "mkdir": files.mkdir,
            "rename": files.rename,
            "watch": watch.watch,
            "identity": self.op_identity,
            "shutdown": self.op_shutdown,
            "sync": storage.sync,
            "mount_volumes": self.in_vm_only(storage.mount_volumes),
            "unmount": self.in_vm_only(storage.unmount),
            "grow_root_fs": self.in_vm_only(storage.grow_root_fs),
            "seal_root_fs": self.in_vm_only(storage.seal_root_fs),
            "freeze_root_fs": self.in_vm_only(storage.freeze_root_fs),
            "thaw_root_fs": self.in_vm_only(storage.thaw_root_fs),
            "end_processes": self.in_vm_only(storage.end_processes),
            "install_ca": self.in_vm_only(trust.install_ca),
            "tcp_connect": tcp.tcp_connect,
        }

    def in_vm_only(self, op: Op) -> Op:
        """`op` changes the machine: refused by an agent that is not a VM's init (tests)."""

        async def guarded(conn: Connection, channel: int, req: Json) -> Json:
            if not self.in_vm:
                raise OpError(p.ErrorCode.INVALID, f"{req.get('op')} only works inside a VM")
            return await op(conn, channel, req)

        return guarded

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
            "protocol": p.PROTOCOL_VERSION,
        }

    async def op_identity(self, conn: Connection, channel: int, req: Json) -> Json:
        """After a restore: the host's clock, fresh entropy, a new hostname and token."""
        if not self.in_vm:
            raise OpError(p.ErrorCode.INVALID, "identity can only change inside a VM")
        if "time_ns" in req:
            time.clock_settime_ns(time.CLOCK_REALTIME, int(req["time_ns"]))
        if "entropy" in req:
            try:
                seed = base64.b64decode(str_arg(req, "entropy"), validate=True)
            except ValueError:
                raise OpError(p.ErrorCode.INVALID, "'entropy' must be base64") from None
            system.add_entropy(seed)
        if "hostname" in req:
            socket.sethostname(str_arg(req, "hostname"))
        if "token" in req:
            token = str_arg(req, "token")
            if len(token) < 16:
                raise OpError(p.ErrorCode.INVALID, "a token needs at least 16 characters")
            self.token = token  # checked at the next HELLO; this connection stays open
        return {"hostname": socket.gethostname(), "time_ns": time.time_ns()}

    async def op_shutdown(self, conn: Connection, channel: int, req: Json) -> Json:
        if not self.in_vm:
            raise OpError(p.ErrorCode.INVALID, "shutdown only applies inside a VM")
        os.sync()
        asyncio.get_running_loop().call_later(0.05, system.power_off)
        return {}

    # --- transports --------------------------------------------------------------------------

    async def serve_stream(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        conn = Connection(self, StreamParts(reader), writer)
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
            wtrans, wproto = await loop.connect_write_pipe(
                lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()),
                os.fdopen(os.dup(fd), "wb", buffering=0),
            )
            writer = asyncio.StreamWriter(wtrans, wproto, None, loop)
            try:
                await Connection(self, PortReader(fd), writer).serve()
            finally:
                wtrans.abort()
            log(HOST_LEFT)

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
        self.processes.reaper = Reaper(asyncio.get_running_loop())
        if listen_unix:
            await self.serve_unix(listen_unix)
            return
        port = system.find_agent_port()
        if port is not None:
            await self.serve_port(port)
        else:
            await self.serve_vsock(p.AGENT_VSOCK_PORT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="space-agent", description=__doc__)
    parser.add_argument("--listen-unix", help="serve a unix socket (testing on a host)")
    parser.add_argument("--token-file", help="read the token from this file, not the kernel")
    args = parser.parse_args(argv)
    in_vm = os.getpid() == 1
    kargs = system.kernel_args() if in_vm else {}
    if in_vm:
        system.init_system(kargs)
        reserve.set_up()
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    else:
        token = kargs.get("space.token", "")
    if not token:
        log("no token given: every connection will be refused")
    agent = Agent(token, in_vm)
    log(f"ready (kernel {os.uname().release})")
    try:
        asyncio.run(agent.run(args.listen_unix))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())

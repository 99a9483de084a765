"""The worker's side of the guest agent protocol: run processes, move files, do platform duties.

`AgentClient` speaks `space.guest.protocol` over whatever byte stream the VMM gives
(`VM.open_agent_stream()`): it authenticates with the sandbox's token, then multiplexes any
number of concurrent operations, each on a channel of its own (see `agent_connection`).

The guest belongs to the tenant, who is root there, so its agent may be hostile: every call has
a deadline (`AgentTimeout`), `run` keeps at most `max_output` bytes of each stream, `read_file`
at most `max_bytes`, a listing at most `limit` entries. Platform duties never run a program of
the guest's: they are the agent's built-in calls (`sync`, `mount_volumes`, `unmount`,
`grow_root_fs`, `seal_root_fs`, `freeze_root_fs`, `thaw_root_fs`, `end_processes`,
`install_ca`, `tcp_connect`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterable, Sequence
from typing import Any, TypedDict, Unpack

from space import tracing
from space.guest import protocol as p
from space.worker import agent_platform as plat
from space.worker.agent_channels import (
    MAX_OUTPUT,
    AgentAuthError,
    AgentConnectionLost,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
    Channel,
    ExecProcess,
    ExecResult,
    SendWindow,
    field,
    within,
)
from space.worker.agent_connection import BUFFER_HIGH, AgentConnection, StreamPair
from space.worker.agent_platform import (
    CAInstall,
    DirListing,
    GuestVolume,
    MountedVolume,
    RootFsGrowth,
    RootFsSealed,
    UnmountResult,
)
from space.worker.agent_tcp import TcpClosed, TcpStream

__all__ = [
    "BUFFER_HIGH",
    "AgentAuthError",
    "AgentClient",
    "AgentConnectionLost",
    "AgentError",
    "AgentProtocolError",
    "AgentTimeout",
    "CAInstall",
    "DirListing",
    "ExecProcess",
    "ExecResult",
    "GuestVolume",
    "MountedVolume",
    "RootFsGrowth",
    "RootFsSealed",
    "StreamPair",
    "TcpClosed",
    "TcpStream",
    "UnmountResult",
]

CALL_DEADLINE_S = 30.0  # a call answered by one REPLY
START_DEADLINE_S = 30.0  # until a process has started, a file transfer or a connection is ready
IDLE_DEADLINE_S = 60.0  # between two frames of a file transfer
RUN_TIMEOUT_S = 60.0
RUN_GRACE_S = 10.0  # after a run's timeout, for the agent to kill it and say so
READ_FILE_MAX = 64 << 20
SYNC_DEADLINE_S = 120.0
MOUNT_DEADLINE_S = 60.0
GROW_DEADLINE_S = 120.0


class ExecOptions(TypedDict, total=False):
    """How the agent runs a process (`space.guest.protocol`, op `exec`)."""

    env: dict[str, str] | None
    cwd: str | None
    user: str | int | None
    timeout: float | None
    stdin: bool  # its stdin stays open for `ExecProcess.write` / `control`
    pty: bool
    rows: int
    cols: int
    max_output: int | None
    background: bool
    tag: str | None


class AgentClient(AgentConnection):
    """An authenticated connection to a guest agent and what it can be asked to do."""

    async def call(
        self, op: str, /, *, deadline: float = CALL_DEADLINE_S, **args: Any
    ) -> dict[str, Any]:
        """A request with a single JSON answer, within `deadline` seconds."""

        async def ask() -> dict[str, Any]:
            ch = await self._open(op, args, keep_frames=False)
            try:
                return await ch.result()
            finally:
                ch.drop()

        with tracing.span(f"agent {op}"):
            return await within(ask(), deadline, op)

    async def ping(self) -> None:
        await self.call("ping", deadline=10.0)

    async def info(self) -> dict[str, Any]:
        return await self.call("info")

    async def exec(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> ExecProcess:
        """Start a process: `cmd` as a string runs through /bin/sh -c, a list is the argv.

        `max_output`: the agent kills the process once a stream has passed that many bytes.
        `background` (or a `tag`): it outlives this channel (`ExecProcess.detach`, `attach`)."""
        return await self._follow("exec", _exec_args(cmd, options), "starting a process")

    async def start(self, cmd: str | list[str], **options: Unpack[ExecOptions]) -> dict[str, Any]:
        """Start a background process and leave it running: its entry in `processes`."""
        args = _exec_args(cmd, {**options, "background": True})
        return await self.call("exec", deadline=START_DEADLINE_S, detach=True, **args)

    async def attach(self, pid: int | None = None, tag: str | None = None,
                     *, replay: bool = True) -> ExecProcess:  # fmt: skip
        """Follow a process the agent started (a background one's kept output first)."""
        return await self._follow("attach", {**_ref(pid, tag), "replay": replay}, "attaching")

    async def processes(self) -> list[dict[str, Any]]:
        listed = field(await self.call("processes"), "processes", list)
        return [entry for entry in listed if isinstance(entry, dict)]

    async def control(self, pid: int | None = None, tag: str | None = None,
                      **what: Any) -> None:  # fmt: skip
        """stdin=bytes, eof=True, signal=n or resize=(rows, cols) for a process, unfollowed."""
        if isinstance(what.get("stdin"), bytes):
            what["stdin"] = base64.b64encode(what["stdin"]).decode()
        if "resize" in what:
            what["resize"] = list(what["resize"])
        await self.call("control", **_ref(pid, tag), **what)

    async def _follow(self, op: str, args: dict[str, Any], what: str) -> ExecProcess:
        with tracing.span(f"agent {op}"):  # until the process has started
            return await self._started(op, args, what)

    async def _started(self, op: str, args: dict[str, Any], what: str) -> ExecProcess:
        ch = await self._open(op, args)
        try:
            started = await ch.first_event(START_DEADLINE_S, what)
            return ExecProcess(ch, field(started, "pid", int), started, owned=op == "exec")
        except BaseException:
            ch.drop()
            raise

    async def run(
        self,
        cmd: str | list[str],
        *,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float = RUN_TIMEOUT_S,
        max_output: int = MAX_OUTPUT,
    ) -> ExecResult:
        """Run a process to its end and collect its output.

        It is killed after `timeout` seconds (`timed_out`), or once stdout or stderr passed
        `max_output` bytes (`truncated`: each stream is cut there). The whole call has a
        deadline a little past `timeout` (AgentTimeout)."""

        async def go() -> ExecResult:
            proc = await self.exec(cmd, env=env, cwd=cwd, user=user, timeout=timeout,
                                   stdin=input is not None, max_output=max_output)  # fmt: skip
            try:
                if input is None:
                    return await proc.wait(max_output)

                async def feed() -> None:
                    await proc.write(input)
                    await proc.close_stdin()

                # Output is read while input is written: a process that echoes must not stall.
                _, result = await asyncio.gather(feed(), proc.wait(max_output))
                return result
            finally:
                proc.drop()

        return await within(go(), timeout + RUN_GRACE_S, f"running {_name(cmd)}")

    def iter_file(
        self, path: str, *, idle_timeout: float = IDLE_DEADLINE_S
    ) -> AsyncIterator[bytes]:
        """A file's contents as they come; each chunk within `idle_timeout` of the last."""
        return self._file_chunks(path, idle_timeout)

    async def _file_chunks(self, path: str, idle_timeout: float) -> AsyncGenerator[bytes, None]:
        ch = await self._open("read_file", {"path": path})
        try:
            await ch.first_event(START_DEADLINE_S, f"reading {path}")
            while True:
                ftype, data = await ch.next_frame(idle_timeout, f"reading {path}")
                if ftype == p.FrameType.DATA:
                    yield data
                elif ftype == p.FrameType.END:
                    break
            await ch.result(idle_timeout, f"reading {path}")
        finally:
            ch.drop()  # a reader that stops early must not hold the rest in memory

    async def watch(
        self, path: str, *, recursive: bool = False
    ) -> AsyncGenerator[dict[str, Any], None]:
        """What changes in directory `path`: {"type": "watching"} first, then each event as
        the agent tells it, then {"type": "end", "reason"} if the watch ended by itself (its
        directory was removed or moved). Closing the generator stops the watch in the guest;
        events wait there (in the kernel's bounded queue) while nobody reads."""
        ch = await self._open("watch", {"path": path, "recursive": recursive})
        try:
            await ch.first_event(START_DEADLINE_S, f"watching {path}")
            yield {"type": "watching", "path": path, "recursive": recursive}
            while (frame := await ch.next_frame())[0] == p.FrameType.EVENT:
                for event in plat.watch_events(frame[1]):
                    yield event
            ended = await ch.result(START_DEADLINE_S, f"watching {path}")
            yield {"type": "end", "reason": str(ended.get("ended"))}
        finally:
            if not ch.reply.done():
                with contextlib.suppress(AgentError):
                    await ch.send_json(p.FrameType.CONTROL, {"stop": True})
            ch.drop()

    async def read_file(self, path: str, *, max_bytes: int = READ_FILE_MAX) -> bytes:
        """A whole file; AgentError "too_large" past `max_bytes`."""
        out = bytearray()
        async with contextlib.aclosing(self._file_chunks(path, IDLE_DEADLINE_S)) as chunks:
            async for chunk in chunks:
                if len(out) + len(chunk) > max_bytes:
                    raise AgentError("too_large", f"{path} is larger than {max_bytes} bytes")
                out += chunk
        return bytes(out)

    async def write_file(
        self,
        path: str,
        data: bytes | Iterable[bytes] | AsyncIterable[bytes],
        *,
        mode: int = 0o644,
        make_parents: bool = False,
    ) -> int:
        """Write a whole file; it appears at `path` only once all of it has arrived."""
        args = {"path": path, "mode": mode, "make_parents": make_parents}
        ch = await self._open("write_file", args)
        try:
            ready = await ch.first_event(START_DEADLINE_S, f"writing {path}")
            window = SendWindow.offered(ch, ready, IDLE_DEADLINE_S, f"writing {path}")
            async for chunk in _chunks(data):
                if ch.reply.done() or not await ch.send_within(p.FrameType.DATA, chunk, window):
                    break  # the agent gave up (e.g. disk full); its reply says why
            await ch.send(p.FrameType.END)
            return field(await ch.result(IDLE_DEADLINE_S, f"writing {path}"), "size", int)
        finally:
            ch.drop()

    async def scan_dir(self, path: str, *, limit: int = 1000) -> DirListing:
        """At most `limit` entries (1-10000) of a directory, in name order; `truncated` says
        there were more (or more than fit one reply)."""
        return plat.dir_listing(await self.call("list_dir", path=path, limit=limit), limit)

    async def list_dir(self, path: str, *, limit: int = 1000) -> list[dict[str, Any]]:
        return (await self.scan_dir(path, limit=limit)).entries

    async def stat(self, path: str) -> dict[str, Any]:
        return await self.call("stat", path=path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self.call("remove", path=path, recursive=recursive, deadline=120.0)

    async def rename(self, path: str, to: str, *, overwrite: bool = False) -> dict[str, Any]:
        return await self.call("rename", path=path, to=to, overwrite=overwrite)

    async def mkdir(self, path: str, *, parents: bool = False, mode: int = 0o755) -> None:
        await self.call("mkdir", path=path, parents=parents, mode=mode)

    async def refresh_identity(
        self, *, hostname: str | None = None, token: str | None = None
    ) -> dict[str, Any]:
        """After a restore: our clock, a reseeded RNG, a new hostname and token for the guest."""
        args: dict[str, Any] = {
            "time_ns": time.time_ns(),
            "entropy": base64.b64encode(os.urandom(64)).decode(),
        }
        if hostname is not None:
            args["hostname"] = hostname
        if token is not None:
            args["token"] = token
        return await self.call("identity", **args)

    async def shutdown(self) -> None:
        await self.call("shutdown")

    # --- platform duties: built into the agent, no program of the guest's runs --------------

    async def sync(
        self, paths: Sequence[str] | None = None, *, deadline: float = SYNC_DEADLINE_S
    ) -> None:
        """Flush the guest's file systems to its disks (sync(2)); with `paths`, only the file
        systems holding those directories (syncfs(2)), so no other mount can hold it up."""
        args = {} if paths is None else {"paths": list(paths)}
        await self.call("sync", deadline=deadline, **args)

    async def mount_volumes(
        self, volumes: Sequence[GuestVolume], *, deadline: float = MOUNT_DEADLINE_S
    ) -> list[MountedVolume]:
        """Mount each volume (an ext4 disk found by its serial) on its target, made if missing;
        read-only ones with `noload`. A disk the guest saw as an empty slot (a restore put the
        volume there) is probed again first. The first failure raises (earlier ones stay)."""
        body = await self.call(
            "mount_volumes", volumes=[v.to_json() for v in volumes], deadline=deadline
        )
        return plat.mounted_volumes(body)

    async def unmount(
        self, targets: Sequence[str], *, deadline: float = MOUNT_DEADLINE_S
    ) -> UnmountResult:
        """Flush and unmount each target (every mount stacked there: a tenant's bind mount on
        top comes off too); `failed` says which could not be, and why."""
        return plat.unmount_result(
            await self.call("unmount", targets=list(targets), deadline=deadline)
        )

    async def grow_root_fs(
        self, min_size: int = 0, *, deadline: float = GROW_DEADLINE_S
    ) -> RootFsGrowth:
        """Grow the mounted root ext4 to its disk's size (EXT4_IOC_RESIZE_FS); `min_size`: the
        disk's new size in bytes, which the guest is waited for to see."""
        body = await self.call("grow_root_fs", min_size=min_size, deadline=deadline)
        return plat.root_fs_growth(body)

    async def seal_root_fs(
        self, *, trim: bool = True, deadline: float = GROW_DEADLINE_S
    ) -> RootFsSealed:
        """Before a build VM stops: discard the root file system's free blocks (`trim`), flush
        it and remount it read-only (so it needs no journal replay), all best effort past the
        flush, which always happens."""
        return plat.root_fs_sealed(await self.call("seal_root_fs", trim=trim, deadline=deadline))

    async def freeze_root_fs(
        self, *, trim: bool = True, deadline: float = GROW_DEADLINE_S
    ) -> int | None:
        """Hold the root file system still and clean (FIFREEZE) while its disk is copied, its
        free blocks discarded first (`trim`); how many bytes those were, None where the disk
        cannot discard. Every write in the guest waits for `thaw_root_fs`."""
        return plat.root_fs_frozen(await self.call("freeze_root_fs", trim=trim, deadline=deadline))

    async def thaw_root_fs(self, *, deadline: float = CALL_DEADLINE_S) -> bool:
        """Let the guest's writes go again; False if the root was not frozen."""
        return plat.root_fs_thawed(await self.call("thaw_root_fs", deadline=deadline))

    async def end_processes(self, *, deadline: float = CALL_DEADLINE_S) -> bool:
        """Kill every process started in the guest and all they started; False if some
        outlived the guest's wait (or it has no cgroups to find them by)."""
        return plat.processes_ended(await self.call("end_processes", deadline=deadline))

    async def install_ca(self, pem: bytes, *, deadline: float = CALL_DEADLINE_S) -> CAInstall:
        """Make `pem` the guest's /etc/space/ca.pem and /etc/space/ca-bundle.pem the system's
        bundle (if it has one) followed by it; both atomic, root's, 0644."""
        body = await self.call("install_ca", pem=pem.decode("ascii"), deadline=deadline)
        return plat.ca_install(body)

    async def tcp_connect(
        self,
        port: int,
        *,
        host: str = "127.0.0.1",
        connect_timeout: float = 10.0,
        idle_timeout: float | None = 300.0,
    ) -> TcpStream:
        """A TCP connection to `host`:`port` inside the guest (`host` must be one of the
        guest's own addresses), streamed both ways with backpressure; see TcpStream.

        AgentError "connection_refused" when nothing listens there, "timeout" when connecting
        took longer than `connect_timeout`."""
        args = {"port": port, "host": host, "timeout": connect_timeout}
        ch = Channel(self, next(self._ids))
        stream = TcpStream(ch, idle_timeout)  # counts the guest's bytes from the first one on
        await self._request(ch, "tcp_connect", args)
        try:
            what = f"connecting to {host}:{port}"
            event = await ch.first_event(connect_timeout + START_DEADLINE_S, what)
            if event.get("connected") is not True:
                raise AgentProtocolError("protocol", f"{what}: no 'connected' event")
            return stream
        except BaseException:
            ch.drop()
            raise


def _exec_args(cmd: str | list[str], options: ExecOptions) -> dict[str, Any]:
    """The agent's `exec` arguments: only what was given, the PTY's size only with a PTY."""
    args: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    given = {k: v for k, v in options.items() if v is not None and v is not False and v != {}}
    if not given.pop("pty", False):
        given.pop("rows", None)
        given.pop("cols", None)
    else:
        args.update(pty=True, rows=given.pop("rows", 24), cols=given.pop("cols", 80))
    return {**args, **given}


def _ref(pid: int | None, tag: str | None) -> dict[str, Any]:
    if (pid is None) == (tag is None):
        raise ValueError("name a process by exactly one of pid or tag")
    return {"pid": pid} if pid is not None else {"tag": tag}


def _name(cmd: str | list[str]) -> str:
    return (cmd if isinstance(cmd, str) else " ".join(cmd))[:60]


async def _chunks(data: bytes | Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(data, bytes | bytearray | memoryview):
        yield bytes(data)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield chunk
    else:
        for chunk in data:
            yield chunk

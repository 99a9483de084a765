"""The worker's side of the guest agent protocol: run processes and move files in a VM.

`AgentClient` speaks `space.guest.protocol` over whatever byte stream the VMM gives
(`VM.open_agent_stream()`): it authenticates with the sandbox's token, then multiplexes any
number of concurrent operations, each on a channel of its own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from space.guest import protocol as p

StreamPair = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Frame = tuple[p.FrameType, bytes]


class AgentError(Exception):
    """The agent refused or failed an operation; `code` says what kind of failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AgentAuthError(AgentError):
    """The agent did not accept our token."""


class AgentConnectionLost(AgentError):
    """The stream to the agent closed (the VM stopped, was paused for a snapshot, or died)."""


_CLOSED: Frame = (p.FrameType.END, b"\x00closed")
BUFFER_HIGH = 16 << 20
BUFFER_LOW = 4 << 20


def _raise_for(body: dict[str, Any]) -> dict[str, Any]:
    err = body.get("error")
    if isinstance(err, dict):
        raise AgentError(str(err.get("code", "internal")), str(err.get("message", err)))
    return body


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    duration_ms: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _Channel:
    def __init__(self, client: AgentClient, cid: int) -> None:
        self.client = client
        self.id = cid
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()
        self.reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.discarded = False

    def put(self, frame: Frame) -> None:
        if self.discarded:
            return
        self.frames.put_nowait(frame)
        self.client._buffered_add(len(frame[1]))

    async def next_frame(self) -> Frame:
        """The next non-REPLY frame; the closed marker (again and again) once the reply came."""
        if self.reply.done() and self.frames.empty():
            return _CLOSED
        frame = await self.frames.get()
        if frame is not _CLOSED:
            self.client._buffered_add(-len(frame[1]))
        return frame

    def discard(self) -> None:
        """Nobody will read this channel any more: drop what it holds and whatever comes."""
        self.discarded = True
        while not self.frames.empty():
            frame = self.frames.get_nowait()
            if frame is not _CLOSED:
                self.client._buffered_add(-len(frame[1]))

    async def send(self, ftype: p.FrameType, payload: bytes = b"") -> None:
        await self.client._send(p.encode(ftype, self.id, payload))

    async def send_json(self, ftype: p.FrameType, obj: dict[str, Any]) -> None:
        await self.client._send(p.encode_json(ftype, self.id, obj))

    async def result(self) -> dict[str, Any]:
        return _raise_for(await self.reply)


class ExecProcess:
    """A process running in the guest. Iterate it for ("stdout"|"stderr", bytes) chunks."""

    def __init__(self, channel: _Channel, pid: int) -> None:
        self._ch = channel
        self.pid = pid

    async def write(self, data: bytes) -> None:
        for i in range(0, len(data), p.CHUNK_SIZE):
            await self._ch.send(p.FrameType.STDIN, data[i : i + p.CHUNK_SIZE])

    async def close_stdin(self) -> None:
        await self._ch.send(p.FrameType.END)

    async def signal(self, signum: int) -> None:
        await self._ch.send_json(p.FrameType.CONTROL, {"signal": int(signum)})

    async def resize(self, rows: int, cols: int) -> None:
        await self._ch.send_json(p.FrameType.CONTROL, {"resize": [rows, cols]})

    async def __aiter__(self) -> AsyncIterator[tuple[str, bytes]]:
        while True:
            ftype, data = await self._ch.next_frame()
            if ftype == p.FrameType.STDOUT:
                yield "stdout", data
            elif ftype == p.FrameType.STDERR:
                yield "stderr", data
            elif (ftype, data) == _CLOSED:
                return

    def discard(self) -> None:
        """Stop buffering this process's output: its reader is gone (see flow control)."""
        self._ch.discard()

    async def wait(self) -> ExecResult:
        """Collect the remaining output and the exit status."""
        out, err = bytearray(), bytearray()
        async for stream, data in self:
            (out if stream == "stdout" else err).extend(data)
        body = await self._ch.result()
        return ExecResult(
            exit_code=body.get("exit_code"),
            signal=body.get("signal"),
            timed_out=bool(body.get("timed_out")),
            stdout=bytes(out),
            stderr=bytes(err),
            duration_ms=float(body.get("duration_ms", 0.0)),
        )


class AgentClient:
    """One authenticated connection to a guest agent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._channels: dict[int, _Channel] = {}
        # Ids start at a random point, so a stale connection's channels never meet new ones.
        self._ids = itertools.count(secrets.randbelow(1 << 30) + 1)
        self._hello: tuple[bytes, bytes, asyncio.Future[bool]] | None = None
        self._send_lock = asyncio.Lock()
        self._lost: AgentConnectionLost | None = None
        # Flow control: the reader stops taking from the agent while more than BUFFER_HIGH bytes
        # wait for consumers, so a slow (or absent) reader pushes back on the guest instead of
        # filling the worker's memory.
        self._buffered = 0
        self._room = asyncio.Event()
        self._room.set()
        self._reader_task = asyncio.ensure_future(self._read_loop())

    @classmethod
    async def connect(
        cls,
        open_stream: Callable[[], Awaitable[StreamPair]],
        token: str,
        timeout: float = 30.0,
    ) -> AgentClient:
        """Open a stream and authenticate; waits up to `timeout` for the agent to answer."""
        reader, writer = await open_stream()
        client = cls(reader, writer)
        try:
            await asyncio.wait_for(client.hello(token), timeout)
        except TimeoutError:
            await client.close()
            raise AgentConnectionLost(
                "timeout", f"the guest agent did not answer within {timeout:.1f}s"
            ) from None
        except BaseException:
            await client.close()
            raise
        return client

    async def hello(self, token: str) -> None:
        """Authenticate; everything the agent sent before its WELCOME is ignored."""
        nonce = secrets.token_hex(8)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._hello = (p.welcome_frame(nonce, True), p.welcome_frame(nonce, False), fut)
        await self._send(p.encode_json(p.FrameType.HELLO, 0, {"token": token, "nonce": nonce}))
        if not await fut:
            raise AgentAuthError("unauthenticated", "the guest agent refused our token")

    async def _send(self, frame: bytes) -> None:
        if self._lost is not None:
            raise self._lost
        async with self._send_lock:
            try:
                self._writer.write(frame)
                await self._writer.drain()
            except (ConnectionError, OSError) as e:
                self._mark_lost(f"write failed: {e}")
                raise self._lost or AgentConnectionLost("lost", str(e)) from None

    async def _read_loop(self) -> None:
        decoder = p.FrameDecoder()
        reason = "the agent closed the connection"
        unsynced = bytearray()
        try:
            while True:
                data = await self._reader.read(p.CHUNK_SIZE)
                if not data:
                    break
                if self._hello is not None:
                    unsynced += data
                    data = self._find_welcome(unsynced)
                    if self._hello is not None:
                        continue
                for ftype, cid, payload in decoder.feed(data):
                    self._route(ftype, cid, payload)
                await self._room.wait()
        except (ConnectionError, OSError) as e:
            reason = f"connection error: {e}"
        self._mark_lost(reason)

    def _find_welcome(self, buf: bytearray) -> bytes:
        """Look for our WELCOME in what has come so far; return what follows it once found."""
        assert self._hello is not None
        accepted, refused, fut = self._hello
        for frame, ok in ((accepted, True), (refused, False)):
            at = buf.find(frame)
            if at >= 0:
                rest = bytes(buf[at + len(frame) :])
                buf.clear()
                self._hello = None
                if not fut.done():
                    fut.set_result(ok)
                return rest
        keep = max(len(accepted), len(refused))
        del buf[:-keep]  # older bytes can no longer start our WELCOME
        return b""

    def _buffered_add(self, n: int) -> None:
        self._buffered += n
        if self._buffered > BUFFER_HIGH:
            self._room.clear()
        elif self._buffered <= BUFFER_LOW:
            self._room.set()

    def _route(self, ftype: p.FrameType, cid: int, payload: bytes) -> None:
        ch = self._channels.get(cid)
        if ch is None:
            return  # left over from before a restore, or a channel we gave up on
        if ftype == p.FrameType.REPLY:
            self._channels.pop(cid, None)
            try:
                body = p.decode_json(payload)
            except p.ProtocolError as e:
                body = p.error_body(p.ErrorCode.INTERNAL, str(e))
            if not ch.reply.done():
                ch.reply.set_result(body)
            ch.frames.put_nowait(_CLOSED)
        else:
            ch.put((ftype, payload))

    def _mark_lost(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = AgentConnectionLost("lost", f"connection to the guest agent lost: {reason}")
        if self._hello is not None and not self._hello[2].done():
            self._hello[2].set_exception(self._lost)
        for ch in self._channels.values():
            if not ch.reply.done():
                ch.reply.set_exception(self._lost)
            ch.frames.put_nowait(_CLOSED)
        self._channels.clear()

    @property
    def connected(self) -> bool:
        return self._lost is None

    async def close(self) -> None:
        self._mark_lost("closed by the host")
        self._reader_task.cancel()
        with contextlib.suppress(BaseException):
            await self._reader_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- operations --------------------------------------------------------------------------

    async def _open(self, op: str, args: dict[str, Any]) -> _Channel:
        ch = _Channel(self, next(self._ids))
        self._channels[ch.id] = ch
        try:
            await ch.send_json(p.FrameType.REQUEST, {"op": op, **args})
        except BaseException:
            self._channels.pop(ch.id, None)
            raise
        return ch

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        """A request with a single JSON answer."""
        ch = await self._open(op, args)
        return await ch.result()

    async def _first_event(self, ch: _Channel) -> dict[str, Any]:
        """The operation's first EVENT, or its error if it failed before sending one."""
        ftype, payload = await ch.next_frame()
        if ftype == p.FrameType.EVENT:
            return p.decode_json(payload)
        await ch.result()  # raises the agent's error (or the lost connection)
        raise AgentError("internal", f"unexpected {ftype.name} frame before the first event")

    async def ping(self) -> None:
        await self.call("ping")

    async def info(self) -> dict[str, Any]:
        return await self.call("info")

    async def exec(
        self,
        cmd: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bool = False,
        pty: bool = False,
        rows: int = 24,
        cols: int = 80,
    ) -> ExecProcess:
        """Start a process: `cmd` as a string runs through /bin/sh -c, a list is the argv."""
        args: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
        if env:
            args["env"] = env
        if cwd is not None:
            args["cwd"] = cwd
        if user is not None:
            args["user"] = user
        if timeout is not None:
            args["timeout"] = timeout
        if stdin:
            args["stdin"] = True
        if pty:
            args.update(pty=True, rows=rows, cols=cols)
        ch = await self._open("exec", args)
        started = await self._first_event(ch)
        return ExecProcess(ch, int(started["pid"]))

    async def run(
        self,
        cmd: str | list[str],
        *,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
    ) -> ExecResult:
        """Run a process to its end and collect its output."""
        proc = await self.exec(
            cmd, env=env, cwd=cwd, user=user, timeout=timeout, stdin=input is not None
        )
        if input is None:
            return await proc.wait()

        async def feed() -> None:
            await proc.write(input)
            await proc.close_stdin()

        # Output is read while input is written: a process that echoes must not stall both.
        _, result = await asyncio.gather(feed(), proc.wait())
        return result

    async def iter_file(self, path: str) -> AsyncIterator[bytes]:
        ch = await self._open("read_file", {"path": path})
        try:
            await self._first_event(ch)
            while True:
                ftype, data = await ch.next_frame()
                if ftype == p.FrameType.DATA:
                    yield data
                elif ftype == p.FrameType.END:
                    break
            await ch.result()
        finally:
            ch.discard()  # a reader that stops early must not hold the rest in memory

    async def read_file(self, path: str) -> bytes:
        return b"".join([chunk async for chunk in self.iter_file(path)])

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
        await self._first_event(ch)
        async for chunk in _chunks(data):
            if ch.reply.done():
                break  # the agent gave up (e.g. disk full); its reply says why
            for i in range(0, len(chunk), p.CHUNK_SIZE):
                await ch.send(p.FrameType.DATA, chunk[i : i + p.CHUNK_SIZE])
        await ch.send(p.FrameType.END)
        return int((await ch.result())["size"])

    async def list_dir(self, path: str) -> list[dict[str, Any]]:
        return list((await self.call("list_dir", path=path))["entries"])

    async def stat(self, path: str) -> dict[str, Any]:
        return await self.call("stat", path=path)

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self.call("remove", path=path, recursive=recursive)

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


async def _chunks(data: bytes | Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(data, bytes | bytearray | memoryview):
        yield bytes(data)
    elif isinstance(data, AsyncIterable):
        async for chunk in data:
            yield chunk
    else:
        for chunk in data:
            yield chunk

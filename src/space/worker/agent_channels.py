"""One operation's channel on an agent connection, the errors an operation can end in, and a
process in the guest (`ExecProcess`).

The guest is the tenant's, and so may be its agent: nothing here trusts what comes back. A
channel holds only what its reader has not taken yet (the connection's flow control bounds
that), a collected run at most `max_output` per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from space.guest import protocol as p

if TYPE_CHECKING:
    from space.worker.agent_connection import AgentConnection

Frame = tuple[p.FrameType, bytes]
T = TypeVar("T")

MAX_OUTPUT = 1 << 20  # bytes of each stream a collected run keeps unless told otherwise


class AgentError(Exception):
    """The agent refused or failed an operation; `code` says what kind of failure."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AgentAuthError(AgentError):
    """The agent did not accept our token."""


class AgentConnectionLost(AgentError):
    """The stream to the agent closed (the VM stopped, was paused for a snapshot, or died), or
    the agent broke the protocol and we dropped it."""


class AgentTimeout(AgentError):
    """The agent did not answer (or take our data) within the call's deadline."""


class ProcessDetached(AgentError):
    """The channel stopped following the process (it runs on)."""


class AgentProtocolError(AgentError):
    """The agent answered with something that is not a valid answer."""


async def within(aw: Awaitable[T], seconds: float | None, what: str) -> T:
    """`aw`, or AgentTimeout once `seconds` have passed (None: no deadline)."""
    if seconds is None:
        return await aw
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        message = f"{what}: no answer from the guest within {seconds:g}s"
        raise AgentTimeout("timeout", message) from None


def raise_for(body: dict[str, Any]) -> dict[str, Any]:
    err = body.get("error")
    if isinstance(err, dict):
        raise AgentError(str(err.get("code", "internal"))[:64], str(err.get("message", err))[:4096])
    return body


def field(body: dict[str, Any], key: str, kind: type[T]) -> T:
    """`body[key]` if it is a `kind` (an int is never a bool here), else AgentProtocolError."""
    value = body.get(key)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise AgentProtocolError("protocol", f"the agent's answer has no valid {key!r}")
    return value


CLOSED: Frame = (p.FrameType.END, b"\x00closed")


class Channel:
    def __init__(self, client: AgentConnection, cid: int, *, keep_frames: bool = True) -> None:
        self.client = client
        self.id = cid
        self.frames: asyncio.Queue[Frame] = asyncio.Queue()
        self.reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.discarded = not keep_frames  # a call answered by its REPLY alone keeps no frames
        # Sees each frame as it arrives; True: it was handled there and is not queued.
        self.intercept: Callable[[p.FrameType, bytes], bool] | None = None

    def put(self, frame: Frame) -> None:
        if self.intercept is not None and self.intercept(*frame):
            return
        if self.discarded:
            return
        self.frames.put_nowait(frame)
        self.client._buffered_add(len(frame[1]))

    def close_frames(self) -> None:
        """No more frames will come (its REPLY came, or the connection went)."""
        self.frames.put_nowait(CLOSED)

    async def next_frame(self, timeout: float | None = None, what: str = "") -> Frame:
        """The next non-REPLY frame; the closed marker (again and again) once the reply came."""
        if self.reply.done() and self.frames.empty():
            return CLOSED
        frame = await within(self.frames.get(), timeout, what or f"channel {self.id}")
        if frame is not CLOSED:
            self.client._buffered_add(-len(frame[1]))
        return frame

    def discard(self) -> None:
        """Nobody will read this channel any more: drop what it holds and whatever comes."""
        self.discarded = True
        while not self.frames.empty():
            frame = self.frames.get_nowait()
            if frame is not CLOSED:
                self.client._buffered_add(-len(frame[1]))

    def drop(self) -> None:
        """Nobody waits for this channel's reply either: forget it."""
        self.discard()
        self.client._channels.pop(self.id, None)

    async def send(self, ftype: p.FrameType, payload: bytes = b"") -> None:
        await self.client._send(p.encode(ftype, self.id, payload))

    async def send_json(self, ftype: p.FrameType, obj: dict[str, Any]) -> None:
        await self.client._send(p.encode_json(ftype, self.id, obj))

    async def send_within(self, ftype: p.FrameType, data: bytes, window: SendWindow | None) -> bool:
        """`data` in frames of at most CHUNK_SIZE, each within `window` where the agent offered
        one; False once the operation ended meanwhile (the rest is not sent)."""
        for i in range(0, len(data), p.CHUNK_SIZE):
            piece = data[i : i + p.CHUNK_SIZE]
            if window is not None and not await window.take(len(piece)):
                return False
            await self.send(ftype, piece)
        return True

    async def result(self, timeout: float | None = None, what: str = "") -> dict[str, Any]:
        return raise_for(await within(asyncio.shield(self.reply), timeout, what or "reply"))

    async def first_event(self, timeout: float | None, what: str) -> dict[str, Any]:
        """The operation's first EVENT, or its error if it failed before sending one."""
        ftype, payload = await self.next_frame(timeout, what)
        if ftype == p.FrameType.EVENT:
            try:
                return p.decode_json(payload)
            except p.ProtocolError as e:
                raise AgentProtocolError("protocol", f"{what}: {e}") from None
        await self.result(timeout, what)  # raises the agent's error (or the lost connection)
        raise AgentProtocolError("protocol", f"{what}: a {ftype.name} frame before its start")


class SendWindow:
    """Our bytes in flight on a channel whose agent tells what it consumed (EVENT {"ack": n}):
    a sender waits while `size` of them are unacknowledged, so the guest never holds more than
    that of ours for a slow consumer (its disk, a process that reads slowly, a socket)."""

    def __init__(self, channel: Channel, size: int, idle: float | None, what: str) -> None:
        self._ch = channel
        self.size = size
        self._idle = idle
        self._what = what
        self._in_flight = 0
        self._room = asyncio.Event()
        self._room.set()

    @classmethod
    def offered(
        cls, channel: Channel, started: dict[str, Any], idle: float | None, what: str
    ) -> SendWindow | None:
        """The window an operation's first event offers, taking its acknowledgements as they
        come; None from an agent that offers none (an older one), which is then sent to freely."""
        size = started.get("window")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            return None
        window = cls(channel, size, idle, what)
        channel.intercept = window.on_frame
        return window

    def on_frame(self, ftype: p.FrameType, payload: bytes) -> bool:
        """Takes an acknowledgement (True: the frame was one)."""
        if ftype != p.FrameType.EVENT:
            return False
        try:
            ack = p.decode_json(payload).get("ack")
        except p.ProtocolError:
            return False
        if not isinstance(ack, int) or isinstance(ack, bool):
            return False
        self.acked(ack)
        return True

    def acked(self, n: int) -> None:
        if n > 0:
            self._in_flight = max(0, self._in_flight - n)
            self._room.set()

    def wake(self) -> None:
        """Let a waiting sender see that the channel ended."""
        self._room.set()

    async def take(self, n: int) -> bool:
        """Room for `n` more bytes (one piece at most `size`): True once there is; False if the
        operation ended meanwhile (nothing more of ours is wanted); its error if it failed."""
        while self._in_flight and self._in_flight + n > self.size:
            if self._ch.reply.done():
                await self._ch.result()
                return False
            self._room.clear()
            room = asyncio.ensure_future(self._room.wait())
            try:
                futures: list[asyncio.Future[Any]] = [room, self._ch.reply]
                either = asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
                await within(either, self._idle, self._what)
            except AgentTimeout:
                if not self._ch.reply.done():
                    raise  # else its answer, which came at the same time, says how it went
            finally:
                room.cancel()
        self._in_flight += n
        return True


# --- processes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    duration_ms: float
    truncated: bool = False  # a stream passed `max_output`: the process was killed there

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecProcess:
    """A process running in the guest. Iterate it for ("stdout"|"stderr", bytes) chunks."""

    def __init__(
        self,
        channel: Channel,
        pid: int,
        started: dict[str, Any] | None = None,
        *,
        owned: bool = True,
    ) -> None:
        self._ch = channel
        self.pid = pid
        self.owned = owned  # this channel started it (rather than attached to it)
        started = started or {}
        self.tag = started.get("tag") if isinstance(started.get("tag"), str) else None
        self.running = started.get("running") is not False
        self.background = started.get("background") is True
        dropped = started.get("dropped")
        self.dropped = dropped if isinstance(dropped, int) else 0  # output the ring lost
        # Input waits while the process has not read a window's worth, as a pipe's writer would.
        self._stdin = SendWindow.offered(channel, started, None, f"process {pid}'s input")

    async def detach(self) -> None:
        """Stop following the process, which runs on; `wait()` then raises ProcessDetached."""
        await self._ch.send_json(p.FrameType.CONTROL, {"detach": True})

    async def write(self, data: bytes) -> bool:
        """Input for the process; False once it takes no more (it ended): the rest is dropped,
        as a pipe's would be."""
        return await self._ch.send_within(p.FrameType.STDIN, data, self._stdin)

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
            elif (ftype, data) == CLOSED:
                return

    def discard(self) -> None:
        """Stop buffering this process's output: its reader is gone (see flow control)."""
        self._ch.discard()

    def drop(self) -> None:
        """Forget the process altogether (it may go on running in the guest)."""
        self._ch.drop()

    async def wait(self, max_output: int | None = MAX_OUTPUT) -> ExecResult:
        """Collect the remaining output and the exit status.

        At most `max_output` bytes of each stream are kept (None: all of it): past it the
        process is killed and the rest dropped as it comes, whatever the agent does. (A reader
        that iterated the process first finds nothing left here.)"""
        out, err = bytearray(), bytearray()
        truncated = False
        async for stream, data in self:
            buf = out if stream == "stdout" else err
            if max_output is not None and len(buf) + len(data) > max_output:
                data = data[: max_output - len(buf)]
                if not truncated:
                    truncated = True
                    with contextlib.suppress(AgentError):
                        await self.signal(signal.SIGKILL)
            buf.extend(data)
        body = await self._ch.result()
        if body.get("detached") is True:
            raise ProcessDetached("detached", f"process {self.pid} was detached and runs on")
        return ExecResult(
            exit_code=_optional_int(body, "exit_code"),
            signal=_optional_int(body, "signal"),
            timed_out=bool(body.get("timed_out")),
            stdout=bytes(out),
            stderr=bytes(err),
            duration_ms=_number(body, "duration_ms"),
            truncated=truncated or bool(body.get("truncated")),
        )


def _optional_int(body: dict[str, Any], key: str) -> int | None:
    return None if body.get(key) is None else field(body, key, int)


def _number(body: dict[str, Any], key: str) -> float:
    value = body.get(key, 0.0)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0

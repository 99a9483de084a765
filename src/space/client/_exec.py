"""Reading a command's run off the wire, for the sync and async clients and the shell alike.

`POST .../exec` answers NDJSON, one event per line (`start`, `stdout`/`stderr` with base64 data,
then `exit` or `error`); the WebSocket carries the same events as text messages and the output as
binary messages tagged by their first byte. `ExecDecoder` turns either into `(stream, bytes)`
pairs and, at the end, the `ExecResult`.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, Literal

from space.client._errors import ConnectionError, ExecError, SpaceError
from space.client._models import ExecResult

Stream = Literal["stdout", "stderr"]
Output = tuple[Stream, bytes]
OutputCallback = Callable[[bytes], object]

_WS_STREAMS: dict[int, Stream] = {1: "stdout", 2: "stderr"}


class ExecDecoder:
    """Events in, output out; holds the pid once started and the result once exited."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.pid: int | None = None
        self.result: ExecResult | None = None

    def feed(self, chunk: bytes) -> list[Output]:
        """The output in a piece of the NDJSON body, which may end or begin mid-line."""
        self._buffer += chunk
        lines = self._buffer.split(b"\n")
        self._buffer = bytearray(lines.pop())
        return self._lines(lines)

    def end(self) -> list[Output]:
        """The body has ended: its last line needs no newline, but an exit event must be there."""
        out = self._lines([bytes(self._buffer)])
        self._buffer.clear()
        if self.result is None:
            raise ConnectionError("the exec stream ended before the process exited")
        return out

    def _lines(self, lines: list[bytes] | list[bytearray]) -> list[Output]:
        out = []
        for line in lines:
            if line.strip():
                try:
                    event = json.loads(line)
                except ValueError as e:
                    raise SpaceError(f"malformed exec stream line {bytes(line)[:100]!r}") from e
                if (item := self.event(event)) is not None:
                    out.append(item)
        return out

    def event(self, event: Mapping[str, Any]) -> Output | None:
        """One event (a decoded NDJSON line or a WebSocket text message)."""
        kind = event.get("type")
        if kind == "stdout" or kind == "stderr":
            return kind, base64.b64decode(event["data"])
        if kind == "start":
            self.pid = event.get("pid")
        elif kind == "exit":
            self.result = ExecResult.from_exit_event(event)
        elif kind == "error":
            raise ExecError(str(event.get("code")), str(event.get("message")))
        # Other types are newer than this SDK: skipping them keeps old clients working.
        return None


def ws_output(message: bytes) -> Output:
    """A binary WebSocket message: one byte naming the stream, then the data."""
    stream = _WS_STREAMS.get(message[0]) if message else None
    if stream is None:
        raise SpaceError(f"unexpected exec WebSocket message starting {message[:8]!r}")
    return stream, message[1:]


class ExecStreamBase:
    """What the sync and async `ExecStream`s share: decoding and the result."""

    def __init__(self) -> None:
        self._decoder = ExecDecoder()

    @property
    def pid(self) -> int | None:
        return self._decoder.pid

    @property
    def finished(self) -> bool:
        return self._decoder.result is not None

    @property
    def result(self) -> ExecResult:
        """How the command ended; there once the iteration is over."""
        if self._decoder.result is None:
            raise SpaceError("the command has not finished: iterate its output to the end first")
        return self._decoder.result


class OutputCollector:
    """Gathers a command's output for `exec`, passing each piece to the callbacks as it comes."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> None:
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._parts: dict[str, list[bytes]] = {"stdout": [], "stderr": []}

    def add(self, stream: Stream, data: bytes) -> None:
        self._parts[stream].append(data)
        if (callback := self._callbacks[stream]) is not None:
            callback(data)

    def result(self, ended: ExecResult) -> ExecResult:
        return dataclasses.replace(
            ended, stdout=b"".join(self._parts["stdout"]), stderr=b"".join(self._parts["stderr"])
        )

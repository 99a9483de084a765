"""File watches (`sandbox.files.watch`): the NDJSON stream of `/files/watch` as FileEvents.

A watch is set in the sandbox before `watch()` returns, so whatever changes after that call is
seen; iterating waits for the next event. The stream ends when the watched directory is
removed or moved (`ended` says which) or when the watch is closed, which stops it in the guest.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING, Any

from space.client._errors import SpaceError
from space.client._models import FileEvent

if TYPE_CHECKING:
    from space.client._async import AsyncSpace
    from space.client._calls import Call
    from space.client._sync import Space


class WatchDecoder:
    """NDJSON lines in, FileEvents out; `watching` once the watch is set, `ended` at its end."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.watching = False
        self.ended: str | None = None

    def feed(self, chunk: bytes) -> list[FileEvent]:
        self._buffer += chunk
        *lines, rest = self._buffer.split(b"\n")
        self._buffer = bytearray(rest)
        return [e for line in lines if line.strip() and (e := self._event(line)) is not None]

    def _event(self, line: bytes | bytearray) -> FileEvent | None:
        try:
            event: dict[str, Any] = json.loads(line)
        except ValueError as e:
            raise SpaceError(f"malformed watch stream line {bytes(line)[:100]!r}") from e
        if event.get("type") == "watching":
            self.watching = True
            return None
        if event.get("type") == "end":
            self.ended = str(event.get("reason"))
            return None
        if event.get("type") == "error":
            raise SpaceError(f"the watch failed: {event.get('message')}")
        return FileEvent.from_json(event)


class FileWatch:
    """Iterate it for FileEvents as they happen; close it (or leave its `with` block) to stop."""

    def __init__(self, client: Space, call: Call[None]) -> None:
        self._decoder = WatchDecoder()
        self._chunks = client._stream(call)
        self._early: list[FileEvent] = []
        try:  # the watch is set (or its error raised) when this returns
            for chunk in self._chunks:
                self._early += self._decoder.feed(chunk)
                if self._decoder.watching:
                    break
            else:
                raise SpaceError("the watch stream ended before the watch was set")
        except BaseException:
            self._chunks.close()
            raise
        self._events = self._read()

    def _read(self) -> Generator[FileEvent]:
        yield from self._early
        with contextlib.closing(self._chunks):
            for chunk in self._chunks:
                yield from self._decoder.feed(chunk)

    @property
    def ended(self) -> str | None:
        """Why the watch ended by itself ("removed", "moved"), once iteration is over."""
        return self._decoder.ended

    def __iter__(self) -> Iterator[FileEvent]:
        return self._events

    def close(self) -> None:
        self._events.close()
        self._chunks.close()

    def __enter__(self) -> FileWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFileWatch:
    """`async for` it for FileEvents; `await close()` (or leave `async with`) to stop. Made
    by `await sandbox.files.watch(...)`, which returns once the watch is set."""

    def __init__(self, client: AsyncSpace, call: Call[None]) -> None:
        self._decoder = WatchDecoder()
        self._chunks = client._stream(call)
        self._early: list[FileEvent] = []

    async def start(self) -> AsyncFileWatch:
        try:
            async for chunk in self._chunks:
                self._early += self._decoder.feed(chunk)
                if self._decoder.watching:
                    return self
            raise SpaceError("the watch stream ended before the watch was set")
        except BaseException:
            await self._chunks.aclose()
            raise

    async def _read(self) -> AsyncGenerator[FileEvent]:
        for event in self._early:
            yield event
        async for chunk in self._chunks:
            for event in self._decoder.feed(chunk):
                yield event

    @property
    def ended(self) -> str | None:
        return self._decoder.ended

    def __aiter__(self) -> AsyncIterator[FileEvent]:
        return self._read()

    async def close(self) -> None:
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncFileWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

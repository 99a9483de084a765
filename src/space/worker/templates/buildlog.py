"""A build's log as a sink for the builder and a live stream for any number of readers.

The builder calls it with each line; the API can hand `follow()` to a streaming response, and a
reader that connects late gets the lines so far first, then the rest as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class BuildLog:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.closed = False
        self._event = asyncio.Event()

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        self._wake()

    def close(self) -> None:
        """The build ended (well or not): readers stop after the last line."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def follow(self, start: int = 0) -> AsyncIterator[str]:
        """Every line from `start` on, waiting for new ones until the log is closed."""
        i = start
        while True:
            while i < len(self.lines):
                yield self.lines[i]
                i += 1
            if self.closed:
                return
            await self._event.wait()

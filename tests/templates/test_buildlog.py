"""The build log: late readers get what came before, then follow until the build ends."""

from __future__ import annotations

import asyncio

from space.worker.templates import BuildLog


async def test_readers_follow_the_log() -> None:
    log = BuildLog()
    log("one")

    async def read() -> list[str]:
        return [line async for line in log.follow()]

    early = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    log("two")
    late = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    log("three")
    log.close()
    assert await early == ["one", "two", "three"]
    assert await late == ["one", "two", "three"]
    assert [line async for line in log.follow(start=2)] == ["three"]

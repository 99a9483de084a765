"""The build log (late readers get what came before, then follow), and cache pruning."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from space.worker.templates import BuildLog, prune_cache


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


def test_prune_removes_only_entries_unused_for_long(tmp_path: Path) -> None:
    cache = tmp_path / "template-cache"
    for key, age in (("old", 7200), ("fresh", 10)):
        (cache / key).mkdir(parents=True)
        (cache / key / "rootfs.ext4").write_bytes(b"x" * 8192)
        (cache / key / "entry.json").write_text("{}")
        then = time.time() - age
        os.utime(cache / key / "entry.json", (then, then))
    (cache / ".tmp-busy").mkdir()  # a build in progress: never touched
    count, freed = prune_cache(tmp_path, 3600)
    assert count == 1 and freed >= 8192
    assert sorted(p.name for p in cache.iterdir()) == [".tmp-busy", "fresh"]

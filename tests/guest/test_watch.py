"""File watches in a real agent: each kind of change told, a recursive watch following a tree
made at once, the end of a watched directory, bad requests refused, nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest

from space.worker.agent_channels import AgentError
from space.worker.agent_client import AgentClient
from tests.guest.conftest import AgentProcess


async def _until(
    events: AsyncGenerator[dict[str, Any], None], want: set[tuple[str, str]], bound_s: float = 10
) -> list[tuple[str, str]]:
    """(type, path) of each event until all of `want` were seen (or the watch ended)."""
    seen: list[tuple[str, str]] = []
    async with asyncio.timeout(bound_s):
        async for event in events:
            seen.append((event["type"], event.get("path") or event.get("reason") or ""))
            if want <= set(seen) or event["type"] == "end":
                break
    return seen


def _inotify_fds(pid: int) -> int:
    fds = Path(f"/proc/{pid}/fd")
    count = 0
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == "anon_inode:inotify"
    return count


async def test_each_kind_of_change_is_told_and_only_at_its_level(
    agent: AgentClient, tmp_path: Path, agent_process: AgentProcess
) -> None:
    before = _inotify_fds(agent_process.pid)
    (tmp_path / "sub").mkdir()
    events = agent.watch(str(tmp_path))
    assert (await anext(events))["type"] == "watching"
    assert _inotify_fds(agent_process.pid) == before + 1
    f, g = tmp_path / "f", tmp_path / "g"
    f.write_text("x")
    (tmp_path / "sub" / "deep").write_text("not at this level")
    f.chmod(0o600)
    f.rename(g)
    g.unlink()
    (tmp_path / "last").touch()
    seen = await _until(events, {("create", str(tmp_path / "last"))})
    told = [e for e in seen if e[1] != str(tmp_path / "sub")]  # the directory's own mtime
    assert told == [
        ("create", str(f)), ("write", str(f)), ("chmod", str(f)), ("rename", str(f)),
        ("create", str(g)), ("remove", str(g)), ("create", str(tmp_path / "last")),
    ], seen  # fmt: skip
    assert not any("deep" in path for _, path in seen)
    await events.aclose()  # stops the watch in the guest
    for _ in range(50):
        if _inotify_fds(agent_process.pid) == before:
            break
        await asyncio.sleep(0.05)
    assert _inotify_fds(agent_process.pid) == before, "a closed watch must release its inotify"


async def test_a_recursive_watch_sees_a_tree_made_at_once(
    agent: AgentClient, tmp_path: Path
) -> None:
    (tmp_path / "old" / "dir").mkdir(parents=True)
    events = agent.watch(str(tmp_path), recursive=True)
    await anext(events)
    (tmp_path / "old" / "dir" / "f").write_text("in a directory there before")
    # A tree made faster than a watch could be added to each new directory.
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "file").write_text("quick")
    want = {
        ("create", str(tmp_path / "old" / "dir" / "f")),
        ("create", str(tmp_path / "a")),
        ("create", str(tmp_path / "a" / "b")),
        ("create", str(tmp_path / "a" / "b" / "c")),
        ("create", str(tmp_path / "a" / "b" / "c" / "file")),
    }
    seen = await _until(events, want)
    assert want <= set(seen), seen
    # The new directories are watched from now on.
    (tmp_path / "a" / "b" / "c" / "file").write_text("again")
    seen = await _until(events, {("write", str(tmp_path / "a" / "b" / "c" / "file"))})
    assert ("write", str(tmp_path / "a" / "b" / "c" / "file")) in seen
    await events.aclose()


async def test_a_watch_ends_with_its_directory(agent: AgentClient, tmp_path: Path) -> None:
    watched = tmp_path / "w"
    watched.mkdir()
    events = agent.watch(str(watched))
    await anext(events)
    (watched / "f").touch()
    (watched / "f").unlink()
    watched.rmdir()
    seen = await _until(events, {("end", "removed")})
    assert seen[-1] == ("end", "removed"), seen
    assert [e async for e in events] == []  # nothing after its end


@pytest.mark.parametrize(
    ("path", "code"),
    [("relative", "invalid"), ("/nonexistent/dir", "not_found"), ("FILE", "not_a_directory")],
)
async def test_bad_watches_are_refused(
    agent: AgentClient, tmp_path: Path, path: str, code: str
) -> None:
    if path == "FILE":
        path = str(tmp_path / "file")
        Path(path).touch()
    events = agent.watch(path)
    with pytest.raises(AgentError) as refused:
        await anext(events)
    assert refused.value.code == code
    await agent.ping()  # the agent goes on serving

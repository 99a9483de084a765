"""What the host reads from an agent is bounded: a run's output, a listing; and the platform's
duties that change a machine are refused by an agent that is not a VM's init."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
from pathlib import Path

import pytest

from space.guest import protocol as p
from space.worker.agent_channels import SendWindow
from space.worker.agent_client import AgentClient, AgentError

from .conftest import AgentProcess


async def test_a_flooding_run_is_cut_off_at_the_cap(
    agent: AgentClient, agent_process: AgentProcess
) -> None:
    r = await agent.run(["yes", "flood"], timeout=30)
    assert r.truncated and r.signal == signal.SIGKILL and not r.timed_out
    assert len(r.stdout) == 1 << 20 and r.stdout.startswith(b"flood\nflood\n")
    # The first stream past the cap ends the process: the other has what it had by then.
    r = await agent.run("yes out & yes err >&2; wait", max_output=4096, timeout=30)
    assert r.truncated and 4096 in (len(r.stdout), len(r.stderr))
    assert len(r.stdout) <= 4096 and len(r.stderr) <= 4096
    assert agent_process.rss_kib() < 200_000


async def test_output_up_to_the_cap_is_whole(agent: AgentClient) -> None:
    r = await agent.run(["head", "-c", "5000", "/dev/zero"], max_output=5000)
    assert (r.exit_code, r.truncated, len(r.stdout)) == (0, False, 5000)


async def test_a_run_has_a_deadline_past_its_timeout(agent: AgentClient) -> None:
    r = await agent.run(["sleep", "30"], timeout=0.5)
    assert r.timed_out and r.duration_ms < 5000


async def test_listings_are_capped_by_count_and_by_size(agent: AgentClient, tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02}").write_bytes(b"")
    listing = await agent.scan_dir(str(tmp_path), limit=10)
    assert listing.truncated and len(listing.entries) == 10
    names = [e["name"] for e in listing.entries]
    assert names == sorted(names)
    whole = await agent.scan_dir(str(tmp_path))
    assert not whole.truncated and len(whole.entries) == 30
    # Long link targets: 200 entries of ~4 KiB each cannot fit one reply; it stops short.
    long = tmp_path / "long"
    long.mkdir()
    for i in range(200):
        (long / f"l{i:03}").symlink_to("x" * 4000)
    listing = await agent.scan_dir(str(long), limit=10_000)
    assert listing.truncated and 0 < len(listing.entries) < 200
    with pytest.raises(AgentError, match="limit"):
        await agent.scan_dir(str(tmp_path), limit=10_001)


async def test_machine_changing_duties_are_refused_outside_a_vm(agent: AgentClient) -> None:
    for op, args in (
        ("mount_volumes", {"volumes": []}),
        ("unmount", {"targets": ["/mnt"]}),
        ("grow_root_fs", {}),
        ("seal_root_fs", {}),
        ("freeze_root_fs", {}),
        ("thaw_root_fs", {}),
        ("end_processes", {}),
        ("install_ca", {"pem": "x"}),
    ):
        with pytest.raises(AgentError, match="only works inside a VM") as e:
            await agent.call(op, **args)
        assert e.value.code == "invalid"


async def test_sync_everything_or_the_file_systems_of_some_paths(
    agent: AgentClient, tmp_path: Path
) -> None:
    await agent.sync()
    await agent.sync([str(tmp_path), "/"])
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(AgentError, match="symbolic link") as e:
        await agent.sync([str(tmp_path / "link")])
    assert e.value.code == "invalid"
    with pytest.raises(AgentError) as e:
        await agent.sync([str(tmp_path / "missing")])
    assert e.value.code == "not_found"


async def test_the_agent_never_sends_a_reply_the_host_would_refuse(agent: AgentClient) -> None:
    """An error message that would make the reply too large comes back as a short error."""
    with pytest.raises(AgentError) as e:
        await agent.call("stat", path="/" + "x" * (p.MAX_JSON + 10))
    assert "the reply would be" in e.value.message and len(e.value.message) < 200


async def test_input_a_process_does_not_read_waits_on_the_host(
    agent: AgentClient, agent_process: AgentProcess
) -> None:
    """The agent holds at most a window of a process's input: the rest waits here, and the
    process can still be signalled meanwhile."""
    proc = await agent.exec(["sleep", "60"], stdin=True)
    before = agent_process.rss_kib()
    writing = asyncio.ensure_future(proc.write(os.urandom(64 << 20)))
    await asyncio.sleep(2)
    assert not writing.done()  # held back by the window, not swallowed by the agent
    assert agent_process.rss_kib() - before < 2 * (p.DATA_WINDOW >> 10) + 8192
    await proc.signal(signal.SIGKILL)
    assert (await proc.wait()).signal == signal.SIGKILL
    # The process ended: the rest of its input is dropped, as a pipe's would be.
    await asyncio.wait_for(writing, 10)


async def test_a_process_that_stops_reading_early_still_answers(agent: AgentClient) -> None:
    """Input past a window that the process never takes (it exited) is dropped: the run
    answers with its result, not an error."""
    r = await agent.run(["head", "-c", "10"], input=os.urandom(8 << 20), timeout=30)
    assert (r.exit_code, len(r.stdout)) == (0, 10)


async def test_input_read_slowly_arrives_whole_within_the_window(agent: AgentClient) -> None:
    data = os.urandom(8 << 20)
    # Reads 64 KiB every 10 ms: the writer goes at the reader's pace, nothing is lost.
    slow = (
        "import sys, time, hashlib\nh = hashlib.sha256()\n"
        "while b := sys.stdin.buffer.read(65536):\n    h.update(b)\n    time.sleep(0.01)\n"
        "print(h.hexdigest())"
    )
    r = await agent.run([sys.executable, "-c", slow], input=data, timeout=60)
    assert r.stdout.decode().strip() == hashlib.sha256(data).hexdigest()


async def test_a_file_is_written_within_the_window(
    agent: AgentClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent acknowledges what it wrote: 32 MiB pass a 1 MiB window, the client never
    having more of it unacknowledged, and the file arrives whole."""
    most = 0
    take = SendWindow.take

    async def counted(window: SendWindow, n: int) -> bool:
        nonlocal most
        taken = await take(window, n)
        most = max(most, window._in_flight)
        return taken

    monkeypatch.setattr(SendWindow, "take", counted)
    data = os.urandom(32 << 20)
    assert await agent.write_file(str(tmp_path / "f"), data) == len(data)
    assert (tmp_path / "f").read_bytes() == data
    assert 0 < most <= p.DATA_WINDOW

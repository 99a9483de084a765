"""Background processes in a real agent: they outlive their channel and their connection,
keep their latest output for the next attach, and take input and signals unfollowed."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from space.worker.agent_channels import AgentError, ProcessDetached
from space.worker.agent_client import AgentClient
from tests.guest.conftest import TOKEN, AgentProcess


async def _connect(agent_socket: Path) -> AgentClient:
    return await AgentClient.connect(
        lambda: asyncio.open_unix_connection(str(agent_socket)), TOKEN, timeout=5
    )


async def _listed(agent: AgentClient, pid: int) -> dict[str, object]:
    return next(entry for entry in await agent.processes() if entry["pid"] == pid)


async def test_a_background_process_outlives_its_connection_and_keeps_its_output(
    agent_socket: Path,
) -> None:
    first = await _connect(agent_socket)
    proc = await first.exec(
        "echo one; read go; echo two; echo err >&2; exit 3", background=True, tag="bg-conn",
        stdin=True,
    )  # fmt: skip
    seen = b""
    async for _, data in proc:
        seen += data
        if b"one\n" in seen:
            break
    await first.close()  # the host goes away: the process must not

    second = await _connect(agent_socket)
    try:
        listed = await _listed(second, proc.pid)
        assert listed["running"] is True and listed["tag"] == "bg-conn"
        await second.control(tag="bg-conn", stdin=b"go\n")
        follower = await second.attach(tag="bg-conn")
        assert follower.pid == proc.pid
        result = await follower.wait()
        # Everything it wrote is there, the part written while nobody listened too.
        assert result.stdout == b"one\ntwo\n" and result.stderr == b"err\n"
        assert result.exit_code == 3
        listed = await _listed(second, proc.pid)
        assert (listed["running"], listed["exit_code"]) == (False, 3)
        # An attach after the end replays the output and answers the result at once.
        again = await second.attach(pid=proc.pid)
        assert not again.running
        assert (await again.wait()).stdout == b"one\ntwo\n"
    finally:
        await second.close()


async def test_detach_leaves_it_running_and_two_followers_see_the_same(
    agent: AgentClient,
) -> None:
    proc = await agent.exec(
        "for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.2; done", background=True
    )
    other = await agent.attach(pid=proc.pid, replay=False)
    await proc.detach()
    with pytest.raises(ProcessDetached):
        await proc.wait()
    assert (await _listed(agent, proc.pid))["running"] is True
    result = await other.wait()
    assert result.exit_code == 0 and result.stdout.endswith(b"8\n")


async def test_the_kept_output_is_the_latest_and_bounded(
    agent: AgentClient, agent_process: AgentProcess
) -> None:
    from space.guest.processes import OUTPUT_RING

    size = 24 * OUTPUT_RING
    started = await agent.start(
        ["sh", "-c", f"head -c {size} /dev/zero | tr '\\0' a; echo END"], tag="flood"
    )
    for _ in range(200):
        if not (await _listed(agent, started["pid"]))["running"]:
            break
        await asyncio.sleep(0.05)
    follower = await agent.attach(tag="flood")
    result = await follower.wait(max_output=None)
    assert len(result.stdout) == OUTPUT_RING
    assert result.stdout.endswith(b"a" * 100 + b"END\n")
    assert follower.dropped == size + 4 - OUTPUT_RING
    assert agent_process.rss_kib() < 200 << 10  # the 24 MiB nobody read were not kept


async def test_control_without_following(agent: AgentClient) -> None:
    started = await agent.start(["cat"], stdin=True, tag="cat-ctl")
    await agent.control(tag="cat-ctl", stdin=b"hello\n", eof=True)
    result = await (await agent.attach(tag="cat-ctl")).wait()
    assert (result.stdout, result.exit_code) == (b"hello\n", 0)

    sleeper = await agent.start(["sleep", "60"])
    await agent.control(pid=sleeper["pid"], signal=signal.SIGTERM)
    assert (await (await agent.attach(pid=sleeper["pid"])).wait()).signal == signal.SIGTERM
    with pytest.raises(AgentError, match="has ended"):
        await agent.control(pid=sleeper["pid"], signal=signal.SIGTERM)
    assert started["tag"] == "cat-ctl"


async def test_a_pty_is_resized_unfollowed(agent: AgentClient) -> None:
    started = await agent.start(
        "read x; stty size", pty=True, rows=10, cols=40, stdin=True, tag="pty-size"
    )
    await agent.control(tag="pty-size", resize=(33, 77))
    await agent.control(tag="pty-size", stdin=b"\n")
    result = await (await agent.attach(pid=started["pid"])).wait()
    assert b"33 77" in result.stdout


async def test_foreground_processes_are_listed_while_they_run_only(agent: AgentClient) -> None:
    proc = await agent.exec(["sleep", "30"])
    follower = await agent.attach(pid=proc.pid)
    await follower.detach()  # an attached channel leaving does not end it
    with pytest.raises(ProcessDetached):
        await follower.wait()
    listed = await _listed(agent, proc.pid)
    assert (listed["running"], listed["background"], listed["argv"]) == (
        True, False, ["sleep", "30"],
    )  # fmt: skip
    await proc.signal(signal.SIGKILL)
    await proc.wait()
    assert proc.pid not in [entry["pid"] for entry in await agent.processes()]
    with pytest.raises(AgentError, match="detached"):
        await agent.call("exec", argv=["true"], detach=True)


async def test_tags_and_references_are_checked(agent: AgentClient) -> None:
    await agent.start(["sleep", "30"], tag="only-one")
    with pytest.raises(AgentError, match="tagged 'only-one'") as taken:
        await agent.start(["true"], tag="only-one")
    assert taken.value.code == "exists"
    for bad in ("123", "", "a b", "x" * 65):
        with pytest.raises(AgentError, match="'tag' must be") as invalid:
            await agent.start(["true"], tag=bad)
        assert invalid.value.code == "invalid"
    with pytest.raises(AgentError, match="no process") as missing:
        await agent.attach(pid=1)
    assert missing.value.code == "not_found"
    with pytest.raises(AgentError, match="'pid'"):
        await agent.call("attach")
    with pytest.raises(AgentError, match="base64"):
        await agent.call("control", tag="only-one", stdin="%%%")
    with pytest.raises(AgentError, match="signal number"):
        await agent.call("control", tag="only-one", signal=0)
    await agent.control(tag="only-one", signal=signal.SIGKILL)


async def test_a_process_is_listed_as_ended_only_with_its_result(agent: AgentClient) -> None:
    # Its grandchild keeps writing after it exits: the exit is seen while its output is still
    # being read, and a listing in between must not say "ended" without saying how.
    for _ in range(20):
        # Started unfollowed: a follower that does not read would hold its output back.
        proc = await agent.start("head -c 64M /dev/zero & exit 0")
        while (listed := await _listed(agent, proc["pid"]))["running"]:
            pass
        assert listed["exit_code"] == 0, listed

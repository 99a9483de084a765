"""Processes in a real VM: the guest kernel, complete separate streams, stdin, exits, timeouts."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal

import pytest

from space.worker.agent_client import AgentError
from space.worker.machine import Machine

pytestmark = pytest.mark.vm


async def test_uname_reports_the_guest_kernel(machine: Machine) -> None:
    r = await machine.agent.run(["uname", "-r"])
    guest = r.stdout.decode().strip()
    assert r.exit_code == 0
    assert guest != os.uname().release
    assert guest.endswith("-cloud-amd64"), guest
    info = await machine.agent.info()
    assert info["agent_pid"] == 1  # the agent is the VM's init


async def test_ten_megabytes_on_each_stream_arrive_whole(machine: Machine) -> None:
    await machine.agent.run(
        "head -c 10000000 /dev/urandom > /tmp/out; head -c 10000000 /dev/urandom > /tmp/err"
    )
    sums = await machine.agent.run("sha256sum /tmp/out /tmp/err")
    want = [line.split()[0] for line in sums.stdout.decode().splitlines()]
    r = await machine.agent.run(
        "cat /tmp/out; cat /tmp/err >&2", timeout=120, max_output=10_000_000
    )
    assert r.exit_code == 0
    assert len(r.stdout) == len(r.stderr) == 10_000_000
    assert [hashlib.sha256(r.stdout).hexdigest(), hashlib.sha256(r.stderr).hexdigest()] == want


async def test_interleaved_streams_keep_their_order(machine: Machine) -> None:
    r = await machine.agent.run("for i in $(seq 1 500); do echo o$i; echo e$i >&2; done")
    assert r.stdout.decode().split() == [f"o{i}" for i in range(1, 501)]
    assert r.stderr.decode().split() == [f"e{i}" for i in range(1, 501)]


async def test_exit_codes_and_signals(machine: Machine) -> None:
    assert (await machine.agent.run("exit 42")).exit_code == 42
    r = await machine.agent.run("kill -KILL $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGKILL)
    proc = await machine.agent.exec(["sleep", "60"])
    await proc.signal(signal.SIGINT)
    assert (await proc.wait()).signal == signal.SIGINT


async def test_stdin_is_piped(machine: Machine) -> None:
    data = os.urandom(1 << 20)
    r = await machine.agent.run(["sha256sum"], input=data)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_input_larger_than_the_guests_memory_passes_through_whole(machine: Machine) -> None:
    """The host sends input no faster than the process takes it: 320 MiB through a 256 MiB
    guest arrive whole, and the agent never holds more than a window of them."""
    digest = hashlib.sha256()
    proc = await machine.agent.exec(["sha256sum"], stdin=True)
    block = os.urandom(1 << 20)

    async def feed() -> None:
        for i in range(320):
            piece = block[:-1] + bytes([i % 256])
            digest.update(piece)
            await proc.write(piece)
        await proc.close_stdin()

    _, r = await asyncio.gather(feed(), proc.wait())
    assert r.exit_code == 0 and r.stdout.split()[0].decode() == digest.hexdigest()


async def test_input_a_process_does_not_read_stays_on_the_host(machine: Machine) -> None:
    proc = await machine.agent.exec(["sleep", "120"], stdin=True)
    writing = asyncio.ensure_future(proc.write(bytes(128 << 20)))
    await asyncio.sleep(3)
    assert not writing.done()
    status = (await machine.agent.run(["cat", "/proc/1/status"])).stdout.decode()
    rss_kib = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1])
    assert rss_kib < 48 << 10, f"the agent holds {rss_kib} KiB"
    await proc.signal(signal.SIGKILL)  # the held-back input does not hold the signal back
    assert (await proc.wait()).signal == signal.SIGKILL
    # The process ended: the rest of its input is dropped, as a pipe's would be.
    await asyncio.wait_for(writing, 30)


async def test_timeout_kills_the_process_and_says_so(machine: Machine) -> None:
    r = await machine.agent.run("echo before; sleep 60; echo after", timeout=1)
    assert r.timed_out
    assert r.signal == signal.SIGKILL
    assert r.stdout == b"before\n"
    assert r.duration_ms < 10_000


async def test_missing_executable_is_a_clear_error(machine: Machine) -> None:
    with pytest.raises(AgentError, match="executable not found: /usr/bin/nope") as e:
        await machine.agent.run(["/usr/bin/nope"])
    assert e.value.code == "not_found"

"""Pause, snapshot and restore of real VMs, and what happens when a VMM dies."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from space.worker.agent_client import (
    AgentAuthError,
    AgentClient,
    AgentConnectionLost,
    AgentError,
)
from space.worker.local import LocalRuntime
from space.worker.machine import Machine
from space.worker.storage.reflink import clone_file
from space.worker.vmm.base import SnapshotInfo, VMState
from space.worker.vmm.process import VMM_NICE
from space.worker.vmm.qemu import QemuVM

from .conftest import leftovers, vmm_pids

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    ">/dev/null 2>&1 & echo $!"
)


async def counter(m: Machine) -> int:
    r = await m.agent.run("cat /tmp/counter 2>/dev/null || echo 0")
    return int(r.stdout.decode().strip() or 0)


async def counter_advances(m: Machine) -> bool:
    before = await counter(m)
    for _ in range(50):
        await asyncio.sleep(0.2)
        if await counter(m) > before:
            return True
    return False


async def test_pause_resume_keeps_processes_running(machine: Machine) -> None:
    pid = int((await machine.agent.run(COUNTER)).stdout)
    assert await counter_advances(machine)
    await machine.pause()
    assert machine.status().state == VMState.PAUSED
    await asyncio.sleep(0.5)
    await machine.resume()
    assert machine.status().state == VMState.RUNNING
    assert (await machine.agent.run(["kill", "-0", str(pid)])).exit_code == 0
    assert await counter_advances(machine)


@pytest.mark.parametrize("mapped", [False, True], ids=["stream", "mapped"])
async def test_snapshot_restore_keeps_processes_and_files_and_renews_identity(
    runtime: LocalRuntime, tmp_path: Path, mapped: bool
) -> None:
    """Either kind of snapshot: QEMU's stream of the guest's memory, or (a base snapshot's)
    the memory as a file that restores map."""
    origin = await Machine.boot(
        runtime.driver, runtime.pool, runtime.images, snapshot_source=mapped
    )
    async with origin:
        pid = int((await origin.agent.run(COUNTER)).stdout)
        await origin.agent.write_file("/root/before-snapshot", b"kept")
        assert await counter_advances(origin)
        snap = await origin.snapshot(runtime.pool.snapshots / f"test-{origin.id}")
        assert snap.took_s > 0 and (snap.path / snap.files["state"]).stat().st_size > 0
        assert ("memory" in snap.files) is mapped
    try:
        # A snapshot outlives its VM: restore it from the directory alone.
        loaded = SnapshotInfo.load(snap.path)
        restored = [await Machine.restore(runtime.driver, runtime.pool, loaded) for _ in range(2)]
        try:
            hostnames, randoms = set(), set()
            for m in restored:
                assert (await m.agent.run(["kill", "-0", str(pid)])).exit_code == 0
                assert await counter_advances(m)
                assert await m.agent.read_file("/root/before-snapshot") == b"kept"
                hostnames.add((await m.agent.run(["hostname"])).stdout)
                randoms.add((await m.agent.run("head -c 32 /dev/urandom | od -An -tx1")).stdout)
                # The guest clock was set from ours, not left at snapshot time.
                guest_ns = (await m.agent.info())["time_ns"]
                assert abs(guest_ns - time.time_ns()) < 5e9
            assert len(hostnames) == 2 and len(randoms) == 2
            # Each clone wrote to its own disk.
            await restored[0].agent.write_file("/root/mine", b"0")
            with pytest.raises(AgentError) as e:
                await restored[1].agent.read_file("/root/mine")
            assert e.value.code == "not_found"
        finally:
            for m in restored:
                await m.close()
    finally:
        shutil.rmtree(snap.path)


@pytest.mark.parametrize("live", [False, True], ids=["paused", "live"])
async def test_a_restored_guest_runs_again_with_the_host_already_on_its_agent_port(
    runtime: LocalRuntime, live: bool
) -> None:
    """The snapshot saw the host connected to the agent's port. Were the host not there when
    the guest runs again, QEMU would tell the guest it left and came back, beside the port's
    data: the guest could drop the connection we authenticated on and ignore what came next.
    A live snapshot's state says "running", and QEMU would start it as soon as it is loaded:
    it is held stopped all the same, by QEMU itself."""
    async with await Machine.boot(runtime.driver, runtime.pool, runtime.images) as origin:
        dest = runtime.pool.snapshots / f"test-{origin.id}"
        snap = await (origin.vm.snapshot_live(dest) if live else origin.snapshot(dest))
    run_dir = runtime.pool.vms / f"paused-{origin.id}"
    run_dir.mkdir()
    try:
        clone_file(snap.path / snap.files["disk"], run_dir / "disk.img")
        config = snap.config.with_changes(rootfs=run_dir / "disk.img", vm_id=run_dir.name)
        vm = await runtime.driver.restore(snap, config, run_dir, paused=True)
        try:
            assert isinstance(vm, QemuVM)
            assert vm.status().state == VMState.PAUSED
            assert await vm.query_status(10) == "paused"
            assert await vm.agent_connected()
        finally:
            await vm.kill()
    finally:
        shutil.rmtree(run_dir)
        shutil.rmtree(snap.path)


async def test_old_token_stops_working_after_restore(runtime: LocalRuntime) -> None:
    async with await Machine.boot(runtime.driver, runtime.pool, runtime.images) as origin:
        snap = await origin.snapshot(runtime.pool.snapshots / f"test-{origin.id}")
    try:
        async with await Machine.restore(runtime.driver, runtime.pool, snap) as clone:
            await clone.agent.close()  # the agent port takes one host connection at a time
            with pytest.raises(AgentAuthError):
                await AgentClient.connect(clone.vm.open_agent_stream, snap.config.agent_token, 10)
            await clone.reconnect()  # the new token works
            assert (await clone.agent.run(["true"])).exit_code == 0
    finally:
        shutil.rmtree(snap.path)


async def test_boot_token_on_the_kernel_command_line_is_dead(machine: Machine) -> None:
    """Guest processes can read /proc/cmdline; the token there must no longer open the agent."""
    cmdline = (await machine.agent.run(["cat", "/proc/cmdline"])).stdout.decode()
    boot_token = next(w for w in cmdline.split() if w.startswith("space.token="))
    boot_token = boot_token.split("=", 1)[1]
    assert boot_token and boot_token != machine.vm.config.agent_token
    await machine.agent.close()  # the agent port takes one host connection at a time
    try:
        with pytest.raises(AgentAuthError):
            await AgentClient.connect(machine.vm.open_agent_stream, boot_token, 10)
    finally:
        await machine.reconnect()
    assert (await machine.agent.run(["true"])).exit_code == 0


async def test_every_vmm_thread_yields_to_the_platform(machine: Machine) -> None:
    """vCPU threads made after start-up are niced too, so a host whose guests burn every core
    still answers its probes (the nice is set before exec, so every thread inherits it)."""
    pid = machine.status().pid
    assert pid is not None
    threads = list(Path(f"/proc/{pid}/task").iterdir())
    assert len(threads) >= 2, threads  # the main thread and at least a vCPU thread
    nices = {t.name: int((t / "stat").read_text().rsplit(")", 1)[1].split()[16]) for t in threads}
    assert set(nices.values()) == {VMM_NICE}, nices


async def test_killed_vmm_is_detected_and_nothing_leaks(runtime: LocalRuntime) -> None:
    before = leftovers(runtime)
    m = await Machine.boot(runtime.driver, runtime.pool, runtime.images)
    status = m.status()
    assert status.pid is not None and status.pid in vmm_pids()
    os.kill(status.pid, signal.SIGKILL)
    final = await asyncio.wait_for(m.vm.wait(), 10)
    assert final.state == VMState.CRASHED
    assert final.reason is not None and "killed by signal 9" in final.reason
    with pytest.raises(AgentConnectionLost):
        await m.agent.run(["true"])
    await m.close()
    assert leftovers(runtime) == before

"""Firecracker for real, on a host where it runs: KVM that boots guests, and `firecracker` and
`jailer` (its release binaries) on the PATH. Our machines have neither (their KVM cannot run a
Linux guest), so here these tests are skipped and the driver is held to the API's spec instead
(`tests/contract/`); a KVM host proves it with

    sudo SPACE_KVM_HOST=1 .venv/bin/pytest tests/kvm

Each VM runs jailed as the worker runs it (`Jail.firecracker`): its own uid, cgroup, chroot
and the network namespace of the tap the worker hands over."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.settings import WorkerSettings
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import Machine
from space.worker.network import netns
from space.worker.network.manager import open_tap_device

pytestmark = [
    pytest.mark.kvm,
    pytest.mark.skipif(
        os.environ.get("SPACE_KVM_HOST") != "1"
        or not (shutil.which("firecracker") and shutil.which("jailer")),
        reason="needs SPACE_KVM_HOST=1, a KVM that runs guests and Firecracker with its jailer",
    ),
]


@pytest.fixture(scope="module")
async def runtime() -> LocalRuntime:
    return await local_runtime(WorkerSettings(driver="firecracker"))


@pytest.fixture
async def tap() -> AsyncIterator[int]:
    name = f"kvm-{uuid.uuid4().hex[:8]}"
    fd = netns.create(name, lambda: open_tap_device("tap0"))
    try:
        yield fd
    finally:
        os.close(fd)
        netns.remove(name)


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


async def test_a_jailed_firecracker_vm_boots_snapshots_and_restores_with_its_nic(
    runtime: LocalRuntime, tap: int
) -> None:
    m = await Machine.boot(runtime.driver, runtime.pool, runtime.images, tap_fd=tap,
                           guest_mac="06:00:ac:10:00:02")  # fmt: skip
    try:
        pid = m.status().pid
        assert pid is not None
        st = _status(pid)
        assert st["Uid"].split()[0] != "0" and st["CapEff"] == "0000000000000000"
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        r = await m.agent.run(["sh", "-c", "cat /sys/class/net/eth0/address; uname -r"])
        assert r.exit_code == 0 and r.stdout.startswith(b"06:00:ac:10:00:02"), r
        await m.agent.write_file("/root/kept", b"kept")
        snap = await m.snapshot(runtime.pool.snapshots / f"kvm-{m.id}")
    finally:
        await m.close()
    try:
        assert "memory" in snap.files  # Firecracker's snapshots always keep memory as a file
        async with await Machine.restore(runtime.driver, runtime.pool, snap, tap_fd=tap) as back:
            assert await back.agent.read_file("/root/kept") == b"kept"
    finally:
        shutil.rmtree(snap.path, ignore_errors=True)

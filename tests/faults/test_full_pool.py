"""A full pool, on a worker of its own small btrfs pool: QEMU stops a guest whose write finds no
room; the worker reports it, refuses new disks (507) at once, answers a suspend without
hanging, and runs the guest on once there is room again: the write completes, nothing lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.settings import WorkerSettings
from space.worker.local import local_runtime
from space.worker.sandboxes import ManagerOptions, NoRoom, VMManager, VMManagerError
from space.worker.sandboxes.recovery import Watch
from space.worker.vmm.base import VMMError

from .conftest import record

pytestmark = pytest.mark.vm

POOL_GIB = 3


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[VMManager]:
    if os.geteuid() != 0:
        pytest.fail("needs root (loop devices, btrfs, QEMU)")
    # Short: the VMs' unix sockets live under it (108 bytes at most for a socket's path).
    mount = Path(tempfile.mkdtemp(prefix="spf-", dir="/tmp"))
    image = tmp_path / "pool.img"
    with open(image, "wb") as f:
        f.truncate(POOL_GIB << 30)
    await sh("mkfs.btrfs", "-q", str(image))
    await sh("mount", "-o", "loop", str(image), str(mount))
    m: VMManager | None = None
    try:
        rt = await local_runtime(WorkerSettings(pool_dir=mount))
        m = VMManager(rt.driver, rt.pool, rt.images, f"full-{uuid.uuid4().hex[:6]}",
                      ManagerOptions(capacity_memory_mib=4096, reserve_mib=512))  # fmt: skip
        await m.start()
        yield m
    finally:
        if m is not None:
            for sb in m.vms():
                with contextlib.suppress(VMManagerError, VMMError):
                    await m.delete(sb.id)
            await m.close(stop_vms=True)
        await sh("umount", "-l", str(mount))
        image.unlink(missing_ok=True)
        mount.rmdir()


def _fill(directory: Path) -> None:
    """Take every free byte of the file system (in 16 MiB pieces, until none fits)."""
    for i in range(100_000):
        if subprocess.run(["fallocate", "-l", "16M", str(directory / f"{i}")],
                          capture_output=True, check=False).returncode:  # fmt: skip
            (directory / f"{i}").unlink(missing_ok=True)
            return


async def sh(*argv: str) -> None:
    await asyncio.to_thread(subprocess.run, argv, check=True)


async def until(check: object, timeout: float) -> float:
    started = time.monotonic()
    while not check():  # type: ignore[operator]
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not reached within {timeout} s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def test_a_full_pool_stops_a_guest_until_there_is_room(manager: VMManager) -> None:
    watch = asyncio.ensure_future(Watch(manager).run())
    try:
        sb = await manager.create("filler", disk_mib=2048)
        agent = sb.machine.agent if sb.machine else None
        assert agent is not None
        ballast = manager.pool.root / "ballast"
        ballast.mkdir()
        await asyncio.to_thread(_fill, ballast)
        # 300 MiB into a pool with no room left: QEMU stops the guest on the write error.
        writer = await agent.exec(
            ["/bin/sh", "-c", "dd if=/dev/urandom of=/root/big bs=1M count=300 conv=fsync"]
        )
        seen = await until(lambda: manager.get("filler").state == "error", 60)
        record("pool full under a writing guest", "the VM shown stopped by an I/O error",
               10.0, seen)  # fmt: skip
        assert "I/O error" in (manager.get("filler").reason or "")
        started = time.monotonic()
        with pytest.raises(NoRoom, match="full"):
            await manager.create("refused", disk_mib=1024)
        record("create on a full pool", "refused at once (507, the reason)", 1.0,
               time.monotonic() - started)  # fmt: skip
        started = time.monotonic()
        with contextlib.suppress(VMManagerError, VMMError):
            await manager.suspend("filler")  # no room for its memory: it fails, quickly
        record("suspend of a VM stopped by a full pool", "answered, not held", 15.0,
               time.monotonic() - started)  # fmt: skip
        await asyncio.to_thread(shutil.rmtree, ballast)
        back = await until(lambda: manager.get("filler").state == "running", 60)
        record("room again on the pool", "the VM runs on by itself", 10.0, back)
        result = await asyncio.wait_for(writer.wait(), 120)
        assert result.exit_code == 0, result
        r = await agent.run(["stat", "-c", "%s", "/root/big"], timeout=30)
        assert r.stdout.strip() == str(300 << 20).encode(), "the write completed, nothing lost"
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch

"""A full pool, on a worker of its own small btrfs pool: the guest's own disk turns full, so its
write fails in the guest (ENOSPC) and the guest runs on; the worker refuses new disks and
suspends (507) at once, leaving the guest running, and gives the guest its room back once the
pool has room again: a new write completes, nothing written before is lost."""

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
from space.worker.sandboxes.fullpool import RESERVE_FILE
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


async def test_a_full_pool_fills_the_guests_disk_until_there_is_room(manager: VMManager) -> None:
    watcher = Watch(manager)
    watch = asyncio.ensure_future(watcher.run())
    try:
        sb = await manager.create("filler", disk_mib=2048)
        agent = sb.machine.agent if sb.machine else None
        assert agent is not None
        before = await agent.run(["/bin/sh", "-c", "head -c 1048576 /dev/urandom > /root/before"
                                  " && sync && sha256sum /root/before"], timeout=60)  # fmt: skip
        assert before.exit_code == 0, before
        await until(lambda: (manager.root / RESERVE_FILE).exists(), 30)
        ballast = manager.pool.root / "ballast"
        ballast.mkdir()
        await asyncio.to_thread(_fill, ballast)
        # 300 MiB into a pool with no room left: the guest's own disk turns full, so the write
        # fails in the guest with ENOSPC, and the guest runs on.
        started = time.monotonic()
        r = await agent.run(
            ["/bin/sh", "-c", "dd if=/dev/urandom of=/root/big bs=1M count=300 conv=fsync"],
            timeout=120,
        )
        assert r.exit_code != 0 and b"No space left on device" in r.stderr, r
        record("pool full under a writing guest", "the write fails in the guest (ENOSPC)",
               30.0, time.monotonic() - started)  # fmt: skip
        await until(lambda: manager.get("filler").state == "running", 30)
        assert (await agent.run(["echo", "answers"], timeout=10)).stdout == b"answers\n"
        started = time.monotonic()
        with pytest.raises(NoRoom, match="full"):
            await manager.create("refused", disk_mib=1024)
        record("create on a full pool", "refused at once (507, the reason)", 1.0,
               time.monotonic() - started)  # fmt: skip
        started = time.monotonic()
        with pytest.raises(NoRoom, match="no room"):
            await manager.suspend("filler")
        record("suspend on a full pool", "refused at once (507), the guest left running", 1.0,
               time.monotonic() - started)  # fmt: skip
        assert manager.get("filler").state == "running"
        await asyncio.to_thread(shutil.rmtree, ballast)
        back = await until(lambda: not watcher.full_pool.full, 60)
        record("room again on the pool", "the guest's disk has its room back", 10.0, back)
        r = await agent.run(
            ["/bin/sh", "-c", "dd if=/dev/urandom of=/root/big bs=1M count=300 conv=fsync"
             " && stat -c %s /root/big && sha256sum /root/before"], timeout=120,
        )  # fmt: skip
        assert r.exit_code == 0, r
        size, digest = r.stdout.decode().split("\n", 1)
        assert size == str(300 << 20), "the write completed"
        assert digest == before.stdout.decode(), "what was written before is intact"
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch

"""Fixtures that boot real microVMs (QEMU microvm; TCG on machines without a working KVM)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import Machine

pytestmark = pytest.mark.vm


def vmm_pids(under: Path | None = None) -> set[int]:
    """VMM processes of ours on this host; with `under`, only those whose VM lives there."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            ours = cmdline.startswith(b"qemu-system") and b"\0-name\0space-" in cmdline
            if ours and (under is None or f"{under}/".encode() in cmdline):
                pids.add(int(proc.name))
    return pids


def leftovers(rt: LocalRuntime) -> dict[str, object]:
    """What VMs leave on a host: processes, run directories, sockets."""
    return {
        "processes": vmm_pids(rt.pool.vms),
        "vm_dirs": sorted(p.name for p in rt.pool.vms.iterdir()),
        "open_fds": len(os.listdir("/proc/self/fd")),
    }


@pytest.fixture(scope="session")
async def runtime() -> LocalRuntime:
    if os.geteuid() != 0:
        pytest.fail("the VM tests need root (loop devices, btrfs, QEMU)")
    return await local_runtime()


@pytest.fixture(scope="module")
async def machine(runtime: LocalRuntime) -> AsyncIterator[Machine]:
    m = await Machine.boot(runtime.driver, runtime.pool, runtime.images)
    yield m
    await m.close()

"""This host's VM runtime, assembled from the worker's settings: pool, images, and the VMM
driver they name (QEMU with the right acceleration, or Firecracker).

Used by the worker service, the debug CLI, the tests and the benchmarks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from space.settings import WorkerSettings
from space.worker.images.debs import Log, log_to_logging
from space.worker.images.defaults import default_images
from space.worker.machine import BootImages
from space.worker.storage.pool import Pool, ensure_pool
from space.worker.vmm.accel import choose_accel
from space.worker.vmm.base import Driver
from space.worker.vmm.jail import Jail
from space.worker.vmm.qemu import QemuDriver


@dataclass(frozen=True)
class LocalRuntime:
    pool: Pool
    images: BootImages
    driver: Driver


async def local_runtime(
    settings: WorkerSettings | None = None, log: Log = log_to_logging
) -> LocalRuntime:
    s = settings or WorkerSettings()
    pool = await asyncio.to_thread(ensure_pool, size_gib=s.pool_image_gib, directory=s.pool_dir)
    images, kernel = await asyncio.to_thread(default_images, pool, log)
    driver: Driver
    if s.driver == "firecracker":
        from space.worker.vmm.firecracker import FirecrackerDriver

        # Firecracker needs KVM. It opens its tap by name, so a VM with a NIC needs its jailer,
        # which puts it in the sandbox's network namespace.
        jailer, on_release = None, None
        if s.jail.enabled:
            jailer, on_release = Jail(s.jail).firecracker("firecracker", pool.root / "jail")
        driver = FirecrackerDriver(
            jailer=jailer,
            on_release=on_release,
            free_page_reporting=s.free_page_reporting,
            shares=s.shares,
        )
    else:
        accel = await asyncio.to_thread(
            choose_accel, kernel.vmlinux, kernel.initrd, kernel.key, s.accel
        )
        driver = QemuDriver(
            accel=accel,
            guest_aslr=s.guest_aslr,
            free_page_reporting=s.free_page_reporting,
            mapped_memory=s.mapped_memory,
            jail=Jail(s.jail) if s.jail.enabled else None,
            shares=s.shares,
        )
    return LocalRuntime(pool=pool, images=images, driver=driver)

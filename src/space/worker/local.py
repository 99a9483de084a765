"""This host's VM runtime, assembled with the defaults: pool, images, QEMU with the right accel.

Used by the debug CLI, the tests and the benchmarks; the worker service builds on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from space.worker.images.debs import Log, log_to_logging
from space.worker.images.defaults import default_images
from space.worker.machine import BootImages
from space.worker.storage.pool import Pool, ensure_pool
from space.worker.vmm.accel import choose_accel
from space.worker.vmm.qemu import QemuDriver


@dataclass(frozen=True)
class LocalRuntime:
    pool: Pool
    images: BootImages
    driver: QemuDriver


async def local_runtime(log: Log = log_to_logging) -> LocalRuntime:
    pool = await asyncio.to_thread(ensure_pool)
    images, kernel = await asyncio.to_thread(default_images, pool, log)
    accel = await asyncio.to_thread(choose_accel, kernel.vmlinux, kernel.initrd, kernel.key)
    return LocalRuntime(pool=pool, images=images, driver=QemuDriver(accel=accel))

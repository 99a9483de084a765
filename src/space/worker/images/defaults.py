"""The images a VM boots by default: the guest kernel, its initramfs and the `base` template."""

from __future__ import annotations

from space.worker.images.base import ensure_base_template
from space.worker.images.debs import Log, log_to_logging
from space.worker.images.kernel import KernelArtifacts, ensure_kernel
from space.worker.machine import BootImages
from space.worker.storage.pool import Pool


def default_images(pool: Pool, log: Log = log_to_logging) -> tuple[BootImages, KernelArtifacts]:
    """Build (or reuse) the kernel and `base`, and make sure the pool holds the template."""
    kernel = ensure_kernel(log=log)
    base = ensure_base_template(log=log)
    rootfs = pool.import_image(base.rootfs, f"base-{base.key}")
    return BootImages(kernel=kernel.vmlinux, initrd=kernel.initrd, rootfs=rootfs), kernel

"""Can this host run guests under KVM? `/dev/kvm` existing proves nothing (see
space.worker.vmm.accel): the answer is the worker's own probe boot of our kernel, whose result
the worker caches per host kernel and guest kernel, so the doctor and the worker agree and a
second run costs nothing. Without a working KVM, QEMU runs guests under TCG: SPACE works,
slowly (a warning), unless SPACE_ACCEL=kvm insists on KVM (a failure)."""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from space.doctor.host import Host
from space.doctor.model import Check, Status
from space.worker.images.debs import CacheSlot
from space.worker.vmm import accel

KVM_GET_API_VERSION = 0xAE00
KVM_API_VERSION = 12  # the only one Linux has ever had

TCG_MEANS = (
    "VMs run under TCG (QEMU's emulator): they work, but boot in seconds rather than "
    "milliseconds, execs are slower, and base snapshots and warm pools matter all the more."
)
FIX_DEVICE = (
    "enable virtualization (VT-x/AMD-V) in the firmware, then `modprobe kvm_intel` (or "
    "`modprobe kvm_amd`); in a VM, turn on nested virtualization; in a container, pass "
    "--device /dev/kvm"
)
FIX_BROKEN = (
    "the hypervisor under this host does not run KVM guests properly: turn on (hardware) nested "
    "virtualization there, or run SPACE on bare metal; SPACE_ACCEL=tcg skips the probe"
)


def check_kvm(host: Host) -> Check:
    if host.accel == "tcg":
        return Check("kvm", "warn", "TCG forced by SPACE_ACCEL=tcg", TCG_MEANS,
                     "unset SPACE_ACCEL to use KVM where a probe boot proves it works")  # fmt: skip
    # Where KVM cannot work, TCG takes over (a warning), unless KVM was insisted on.
    missing: Status = "fail" if host.accel == "kvm" else "warn"
    means = "SPACE_ACCEL=kvm: no VM can start." if host.accel == "kvm" else TCG_MEANS
    device = host.dev("kvm")
    problem = _device_problem(device)
    if problem:
        return Check("kvm", missing, problem, means, FIX_DEVICE)
    kernel = _cached_kernel(host.cache_dir / "kernel")
    if kernel is None:
        return Check(
            "kvm", "warn", f"{device} answers, but no guest has booted under it yet",
            "Only a probe boot of the guest kernel proves KVM works; the kernel is not built.",
            "`space image kernel` (space up does it), then `space doctor` again",
        )  # fmt: skip
    vmlinux, initrd, key = kernel
    if host.accel == "kvm":
        works, why = accel.probe_kvm(vmlinux, initrd)  # the worker does not probe when forced
    else:
        works = accel.choose_accel(vmlinux, initrd, key) == "kvm"
        why = _cached_reason(key) or ("a KVM guest booted" if works else "the probe boot failed")
    if works:
        return Check("kvm", "ok", f"KVM works: {why}")
    if host.accel == "kvm":
        return Check("kvm", "fail", f"{device} is present but broken ({why})", means, FIX_BROKEN)
    return Check(
        "kvm", "warn", f"{device} is present but broken ({why}): VMs will run under TCG",
        f"{means} The worker comes to the same answer by itself (its probe is cached in "
        f"{accel._cache_file()}).",
        FIX_BROKEN,
    )  # fmt: skip


def _device_problem(device: Path) -> str:
    """Why `device` is not a usable KVM device, or "" if it is one."""
    try:
        st = device.stat()
    except FileNotFoundError:
        return f"no {device}: this kernel has no KVM, or it is not loaded"
    except OSError as e:
        return f"cannot look at {device}: {e.strerror}"
    if not stat.S_ISCHR(st.st_mode):
        return f"{device} is not a device node"
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return f"cannot open {device}: {e.strerror} (root, or the kvm group, may open it)"
    try:
        version = fcntl.ioctl(fd, KVM_GET_API_VERSION)
    except OSError as e:
        return f"{device} does not answer as KVM: {e.strerror}"
    finally:
        os.close(fd)
    if version != KVM_API_VERSION:
        return f"{device} speaks KVM API version {version}, not {KVM_API_VERSION}"
    return ""


def _cached_kernel(root: Path) -> tuple[Path, Path, str] | None:
    """A complete guest kernel build in the cache, (vmlinux, initrd, key): the one the worker
    last probed KVM with if it is still there (its answer holds for the host, so no new probe
    boot), else the newest."""
    builds = []
    for manifest in root.glob("*/manifest.json"):
        slot = CacheSlot(root, manifest.parent.name)
        data = slot.load()
        files = data.get("files") if data else None
        if isinstance(files, dict):
            vmlinux, initrd = slot.path / str(files["vmlinux"]), slot.path / str(files["initrd"])
            if vmlinux.is_file() and initrd.is_file():
                probed = _cached_reason(slot.key) is not None
                builds.append((probed, manifest.stat().st_mtime, vmlinux, initrd, slot.key))
    if not builds:
        return None
    *_, vmlinux, initrd, key = max(builds)
    return vmlinux, initrd, key


def _cached_reason(kernel_key: str) -> str | None:
    """Why the worker's probe came to its answer for this kernel, as it wrote it down."""
    known = accel.cached(kernel_key)
    return (known[1] or None) if known is not None else None

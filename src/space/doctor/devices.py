"""Device nodes SPACE uses: /dev/net/tun (every VM's NIC is a tap) and the loop devices (the
worker loop-mounts its btrfs pool image)."""

from __future__ import annotations

import array
import fcntl
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from space.doctor.host import Host
from space.doctor.model import Check

TUNGETFEATURES = 0x800454CF
IFF_TAP = 0x0002
LOSETUP_TIMEOUT_S = 10.0


def _char_device(path: Path) -> str:
    """Why `path` is not a character device node, or "" if it is one."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return f"no {path}"
    except OSError as e:
        return f"cannot look at {path}: {e.strerror}"
    return "" if stat.S_ISCHR(mode) else f"{path} is not a device node"


def check_tun(host: Host) -> Check:
    tun = host.dev("net/tun")
    if not host.network:
        return Check("tun", "ok", "not needed: SPACE_WORKER_NETWORK=0 gives VMs no NIC")
    problem = _char_device(tun)
    if not problem:
        try:
            fd = os.open(tun, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            problem = f"cannot open {tun}: {e.strerror}"
        else:
            try:
                features = array.array("I", [0])
                fcntl.ioctl(fd, TUNGETFEATURES, features)
                if not features[0] & IFF_TAP:
                    problem = f"{tun} cannot make tap devices"
            except OSError as e:
                problem = f"{tun} does not answer as the tun driver: {e.strerror}"
            finally:
                os.close(fd)
    if not problem:
        return Check("tun", "ok", f"{tun} makes tap devices")
    return Check(
        "tun", "fail", problem,
        "Every VM's network card is a tap device made through it: no sandbox can start with "
        "a network (SPACE_WORKER_NETWORK=0 runs VMs without any NIC instead).",
        "`modprobe tun`; if the node is still missing: `mkdir -p /dev/net && mknod /dev/net/tun "
        "c 10 200`; in a container, pass --device /dev/net/tun",
    )  # fmt: skip


def check_loop(host: Host) -> Check:
    control = host.dev("loop-control")
    problem = _char_device(control) or _attach_one()
    if not problem:
        return Check("loop", "ok", "a loop device attaches (losetup)")
    if host.pool_dir is not None:
        return Check(
            "loop", "warn", problem,
            f"Not needed while the pool is SPACE_POOL_DIR ({host.pool_dir}); without it, the "
            "worker loop-mounts its pool image and cannot start.",
            "`modprobe loop`; in a container, pass --device /dev/loop-control and /dev/loopN",
        )  # fmt: skip
    return Check(
        "loop", "fail", problem,
        "The worker keeps its disks in a btrfs image that it loop-mounts: it cannot start. "
        "(An existing btrfs or XFS directory as SPACE_POOL_DIR needs no loop device.)",
        "`modprobe loop` (package kmod); losetup is in package mount; in a container, pass "
        "--device /dev/loop-control and /dev/loopN",
    )  # fmt: skip


def _attach_one() -> str:
    """Attach a loop device to a small file and detach it again: "" when that works."""
    if shutil.which("losetup") is None:
        return "losetup is not installed (package mount)"
    with tempfile.NamedTemporaryFile(prefix="space-doctor-loop-") as backing:
        backing.truncate(1 << 20)
        backing.flush()
        try:
            attached = subprocess.run(
                ["losetup", "--find", "--show", "--read-only", backing.name],
                capture_output=True, text=True, timeout=LOSETUP_TIMEOUT_S, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"losetup did not answer within {LOSETUP_TIMEOUT_S:.0f}s"
        if attached.returncode != 0:
            return f"cannot attach a loop device: {attached.stderr.strip() or 'losetup failed'}"
        device = attached.stdout.strip()
        subprocess.run(["losetup", "--detach", device], capture_output=True,
                       timeout=LOSETUP_TIMEOUT_S, check=False)  # fmt: skip
    return ""

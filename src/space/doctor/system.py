"""The rest of what a SPACE host needs: root, QEMU, the tools that build images, cgroups v2 and
memory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from space.doctor.host import Host
from space.doctor.model import Check, Status
from space.worker.images import debs
from space.worker.images.kernel import BUSYBOX_PACKAGE, KERNEL_METAPACKAGE

QEMU = "qemu-system-x86_64"
QEMU_TESTED = (7, 2)  # what SPACE's figures and tests come from
RUN_TIMEOUT_S = 20.0

# What `space image` and template builds run, and the Debian package each comes in.
IMAGE_TOOLS = {
    "mmdebstrap": "mmdebstrap",
    "mkfs.ext4": "e2fsprogs",
    "e2fsck": "e2fsprogs",
    "resize2fs": "e2fsprogs",
    "tar": "tar",
    "zstd": "zstd",
    "lz4": "lz4",
    "depmod": "kmod",
    "dpkg-deb": "dpkg",
    "apt-get": "apt",
    "findmnt": "util-linux",
    "mountpoint": "util-linux",
}
CGROUP_CONTROLLERS = ("cpu", "memory", "pids")

SANDBOX_MIB = 256 + 64  # a default sandbox, and QEMU's own memory beside it
SERVICES_MIB = 768  # embedded PostgreSQL, API, controller, worker and its gateway
FEW_SANDBOXES = 4


def check_root(host: Host) -> Check:
    uid = os.geteuid()
    if uid == 0:
        return Check("root", "ok", "running as root")
    return Check(
        "root", "fail", f"running as uid {uid}, not root",
        "The worker boots VMs, attaches loop devices and makes network namespaces and nftables "
        "rules: it runs as root (its gateway drops root by itself). Other checks may fail for "
        "this reason alone.",
        "run it as root: `sudo space doctor`, `sudo make up`",
    )  # fmt: skip


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    return done.stdout


def check_qemu(host: Host) -> Check:
    if shutil.which(QEMU) is None:
        return Check("qemu", "fail", f"{QEMU} is not installed", "QEMU runs every microVM here.",
                     "`apt-get install qemu-system-x86`")  # fmt: skip
    banner = _run([QEMU, "--version"]).splitlines()
    found = re.search(r"version (\d+)\.(\d+)(?:\.(\d+))?", banner[0] if banner else "")
    if found is None:
        return Check("qemu", "fail", f"{QEMU} --version answers no version", "",
                     "`apt-get install --reinstall qemu-system-x86`")  # fmt: skip
    version = (int(found[1]), int(found[2]))
    name = f"QEMU {found[0].removeprefix('version ')}"
    if not re.search(r"^microvm\s", _run([QEMU, "-machine", "help"]), re.M):
        return Check(
            "qemu", "fail", f"{name} has no microvm machine",
            "SPACE's VMs are `-M microvm` machines.",
            "QEMU 6.1 or newer: `apt-get install qemu-system-x86` from a current distribution",
        )  # fmt: skip
    if version < QEMU_TESTED:
        return Check(
            "qemu", "warn", f"{name}, older than the {QEMU_TESTED[0]}.{QEMU_TESTED[1]} SPACE is "
            "tested with", "Snapshots and restores may behave differently.",
            "`apt-get install qemu-system-x86` from a current distribution",
        )  # fmt: skip
    return Check("qemu", "ok", f"{name}, with the microvm machine")


def check_firecracker(host: Host) -> Check:
    """Firecracker and its jailer, where the worker is to use them (SPACE_WORKER_DRIVER)."""
    if host.driver != "firecracker":
        return Check("firecracker", "ok", f"not used (SPACE_WORKER_DRIVER={host.driver})")
    means = ("SPACE_WORKER_DRIVER=firecracker runs every VM in Firecracker, jailed by its "
             "jailer (a VM with a network needs it), on KVM.")  # fmt: skip
    fix = "install Firecracker's release binaries `firecracker` and `jailer` on the PATH"
    missing = [b for b in ("firecracker", "jailer") if shutil.which(b) is None]
    if missing:
        return Check("firecracker", "fail", f"{' and '.join(missing)} not found", means, fix)
    banner = _run(["firecracker", "--version"]).splitlines()
    version = banner[0].strip() if banner else "an unknown version"
    if not host.jail:
        return Check("firecracker", "warn", f"{version}, without its jailer (SPACE_WORKER_JAIL=0)",
                     means + " Without the jailer a VM has no network.",
                     "SPACE_WORKER_JAIL=1")  # fmt: skip
    return Check("firecracker", "ok", f"{version} and its jailer")


def check_image_tools(host: Host) -> Check:
    missing = {tool: package for tool, package in IMAGE_TOOLS.items() if not shutil.which(tool)}
    problems = [f"{tool} (package {package})" for tool, package in missing.items()]
    apt_problem = ""
    if "apt-get" not in missing:
        try:
            debs.resolve([BUSYBOX_PACKAGE, KERNEL_METAPACKAGE])
            debs.resolve_kernel(KERNEL_METAPACKAGE)
        except debs.DebError as e:
            apt_problem = str(e)
    if not problems and not apt_problem:
        return Check("tools", "ok", "mmdebstrap, e2fsprogs and the rest are installed; apt "
                     f"offers {BUSYBOX_PACKAGE} and {KERNEL_METAPACKAGE}")  # fmt: skip
    summary = "; ".join(([f"missing: {', '.join(problems)}"] if problems else [])
                        + ([apt_problem] if apt_problem else []))  # fmt: skip
    fixes = []
    if missing:
        fixes.append(f"`apt-get install {' '.join(sorted(set(missing.values())))}`")
    if apt_problem:
        fixes.append("`apt-get update` (apt needs the Debian package lists)")
    built = all(any((host.cache_dir / d).glob("*/manifest.json"))
                for d in ("kernel", "templates/base"))  # fmt: skip
    status: Status = "warn" if built else "fail"
    means = ("The guest kernel and `base` are built already; rebuilding them and building "
             "templates need these." if built else
             "`space image` cannot build the guest kernel or the `base` template, without "
             "which no VM boots.")  # fmt: skip
    return Check("tools", status, summary, means, " and ".join(fixes))


def check_cgroups(host: Host) -> Check:
    root = host.paths.sys / "fs" / "cgroup"
    means = (
        "Every VMM runs jailed in a cgroup of its own (CPU, memory, pids, block I/O): under "
        "cgroup v1 too, but Firecracker's jailer and the io controller's limits want v2."
    )
    try:
        controllers = set((root / "cgroup.controllers").read_text().split())
    except OSError:
        hybrid = (root / "unified" / "cgroup.controllers").exists()
        found = "cgroup v1 (v2 only beside it, at unified/)" if hybrid else "no cgroup v2"
        return Check("cgroups", "warn", f"{found} at {root}", means,
                     "boot with systemd.unified_cgroup_hierarchy=1 (Debian 11 and later do by "
                     "default); in a container, mount /sys/fs/cgroup as cgroup2")  # fmt: skip
    lacking = [c for c in CGROUP_CONTROLLERS if c not in controllers]
    if lacking:
        return Check("cgroups", "warn", f"cgroup v2 at {root} lacks {', '.join(lacking)}", means,
                     f"enable them: `echo +{' +'.join(lacking)} > "
                     f"{root}/cgroup.subtree_control` in the parent")  # fmt: skip
    return Check("cgroups", "ok", f"cgroup v2 with {', '.join(CGROUP_CONTROLLERS)}")


def check_memory(host: Host) -> Check:
    meminfo = host.paths.proc / "meminfo"
    try:
        fields = dict(
            line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line
        )
        available = int(fields["MemAvailable"].split()[0]) // 1024
    except (OSError, KeyError, ValueError) as e:
        return Check("memory", "warn", f"cannot read MemAvailable from {meminfo}: {e}")
    room = (available - SERVICES_MIB - host.reserve_mib) // SANDBOX_MIB
    summary = f"{available} MiB available"
    if room >= FEW_SANDBOXES:
        return Check("memory", "ok", f"{summary}: room for the services, the pool reserve and "
                                     f"~{room} sandboxes of 256 MiB")  # fmt: skip
    least = SERVICES_MIB + SANDBOX_MIB
    status: Status = "warn" if available >= least else "fail"
    if status == "warn":
        summary += ": fewer than a few sandboxes fit"
    else:
        summary += f": not enough for the services and one sandbox ({least} MiB)"
    return Check(
        "memory", status, summary,
        f"The services take ~{SERVICES_MIB} MiB and each default sandbox ~{SANDBOX_MIB} MiB; "
        f"warm pools only use what leaves {host.reserve_mib} MiB free "
        "(SPACE_POOL_RESERVE_MIB), so below that creates are all restores.",
        "free memory or add RAM; smaller sandboxes (`--memory`), a smaller pool "
        "(`space up --pool 0`)",
    )  # fmt: skip

"""The jail every VMM runs in, and the program that puts it there.

The worker runs this file (standard library only, with `python3 -E -s -S`, so it starts in a few
milliseconds) in the VMM's new session with the VMM's descriptors already in place. As root it:

1. moves itself into the VM's cgroups (CPU, memory, pids, block I/O), so everything the VMM
   allocates from its first instruction is counted there;
2. enters the sandbox's network namespace (or a new, empty one), and new mount, IPC and UTS
   namespaces;
3. builds a root of its own on a small tmpfs: the distribution's `/usr` read-only, a few device
   nodes, and the VM's own files (kernel, initramfs, memory file) bind-mounted at the paths
   the VMM's command line names, read-only unless listed as writable; everything else the VMM
   uses (disks, sockets, logs, tap, snapshot streams) it gets as open descriptors;
4. pivots into that root and drops the host's, makes the root read-only;
5. drops every capability from its bounding set, its groups, and becomes the VM's own uid and
   gid, with `no_new_privs`;
6. execs the VMM, which then installs its own seccomp filter.

A failure at any step ends it with exit code 127 and the reason on standard error, which is
the VMM's log: the worker reports it as the VMM's exit.

`JailSpec` is the seam between the worker and this program, typed once here for both sides.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# pivot_root has no libc wrapper.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# Host directories a dynamically linked VMM needs beside /usr: merged-/usr systems have
# symlinks here, others real directories (bound read-only).
LIB_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
EXIT_JAIL = 127
TUNGETDEVNETNS = 0x54E3  # _IO('T', 227): a descriptor of the tap device's namespace


@dataclass(frozen=True)
class JailSpec:
    """One VMM's confinement."""

    uid: int
    gid: int
    # An empty directory of the host's that the new root is mounted on (in the new mount
    # namespace only, so every jail can use the same one).
    root: str
    # The VMM's binary, as a path inside the jail.
    exe: str
    # The VMM's tap (a descriptor it inherits): the jail enters the network namespace the tap's
    # device lives in, the sandbox's. None: a new namespace with nothing in it.
    tap_fd: int | None = None
    # cgroup.procs files to join, one per controller hierarchy.
    cgroups: list[str] = field(default_factory=list)
    # Host paths bound at the same path inside, read-only, or writable.
    read_only: list[str] = field(default_factory=list)
    writable: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=lambda: ["/dev/null", "/dev/zero", "/dev/urandom"])
    nice: int = 0  # added to the VMM's nice value

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JailSpec:
        return cls(**json.loads(text))


_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    source: str, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    _check(
        _libc.mount(
            source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )  # fmt: skip


def _bind(source: str, target: str, read_only: bool, exec_ok: bool = False) -> None:
    """Bind `source` at `target` (an empty file or directory made for it), read-only if asked;
    never set-uid, never device nodes unless `source` is one."""
    _mount(source, target, None, MS_BIND | MS_REC)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID
    if read_only:
        flags |= MS_RDONLY
    if not exec_ok:
        flags |= MS_NOEXEC
    if not source.startswith("/dev/"):
        flags |= MS_NODEV
    _mount("none", target, None, flags)


def _make_target(root: str, path: str, directory: bool) -> str:
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if directory:
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o600))
    return target


def _build_root(spec: JailSpec) -> None:
    root = spec.root
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("space-jail", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,nr_inodes=1024,mode=755")
    _bind("/usr", _make_target(root, "/usr", True), read_only=True, exec_ok=True)
    for name in LIB_DIRS:
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), f"{root}/{name}")
        elif os.path.isdir(host):
            _bind(host, _make_target(root, host, True), read_only=True, exec_ok=True)
    if os.path.exists("/etc/ld.so.cache"):
        _bind("/etc/ld.so.cache", _make_target(root, "/etc/ld.so.cache", False), read_only=True)
    if not spec.exe.startswith("/usr/"):
        _bind(spec.exe, _make_target(root, spec.exe, False), read_only=True, exec_ok=True)
    for device in spec.devices:
        _bind(device, _make_target(root, device, False), read_only=False)
    for path in spec.read_only:
        _bind(path, _make_target(root, path, os.path.isdir(path)), read_only=True)
    for path in spec.writable:
        _bind(path, _make_target(root, path, os.path.isdir(path)), read_only=False)
    os.chdir(root)
    os.mkdir(".host", 0o700)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(0, f"pivot_root: unknown architecture {platform.machine()}")
    _check(_libc.syscall(number, b".", b".host"), "pivot_root")
    _check(_libc.umount2(b".host", MNT_DETACH), "unmount the host's root")
    os.rmdir(".host")
    os.chdir("/")
    # Nothing more is made here: the VMM writes only through the descriptors it was given.
    _mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(spec: JailSpec, last_cap: int) -> None:
    os.setgroups([])
    os.setresgid(spec.gid, spec.gid, spec.gid)
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap}")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    # From root to another uid without SECBIT_KEEP_CAPS: the kernel clears every capability.
    os.setresuid(spec.uid, spec.uid, spec.uid)
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def enter(spec: JailSpec) -> None:
    """Confine the calling process as `spec` says (it must be root, and single-threaded)."""
    for procs in spec.cgroups:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    os.nice(spec.nice)
    namespaces = CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS
    if spec.tap_fd is not None:
        netns = fcntl.ioctl(spec.tap_fd, TUNGETDEVNETNS)
        try:
            _check(_libc.setns(netns, CLONE_NEWNET), "enter the tap's network namespace")
        finally:
            os.close(netns)
    else:
        namespaces |= CLONE_NEWNET
    _check(_libc.unshare(namespaces), "unshare")
    with open("/proc/sys/kernel/cap_last_cap") as f:  # the host's /proc is gone after this
        last_cap = int(f.read())
    _build_root(spec)
    _drop_privileges(spec, last_cap)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.stderr.write("usage: launch.py SPEC-JSON ARGV0 [ARG…]\n")
        os._exit(2)
    try:
        spec = JailSpec.from_json(argv[1])
        enter(spec)
        os.execve(spec.exe, argv[2:], {"PATH": "/usr/bin:/bin"})
    except (OSError, ValueError, TypeError) as e:
        sys.stderr.write(f"jail: {e}\n")
        sys.stderr.flush()
        os._exit(EXIT_JAIL)


if __name__ == "__main__":
    main(sys.argv)

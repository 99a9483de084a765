"""An escape drill: stand in for a VMM a guest has taken over, and try one attack.

Run as root: `python drill.py ATTACK PARAMS-JSON [--as-vmm PID]`. With `--as-vmm`, the process
first takes the exact confinement of the running VMM PID: its cgroups, its network, IPC, UTS
and mount namespaces (so its root is that jail's), copies of its descriptors, its uid and gid
with no capabilities and `no_new_privs`, and its seccomp filter (read from it with ptrace).
Without it the attack runs as plain root on the host: the control that shows the attack
works where nothing stops it.

It prints one JSON line: {"outcome": "done"} when the attack did what it tried, or
{"outcome": "refused", "errno": …} when the system said no. A seccomp kill ends it by SIGSYS,
the memory cgroup's by SIGKILL: the caller reads those from the exit status.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

libc = ctypes.CDLL(None, use_errno=True)

PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_SECCOMP_GET_FILTER = 0x420C
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SYS_PIDFD_GETFD = 438
SYS_FINIT_MODULE = 313
WALL = 0x40000000
CLONE_NEWNS = 0x00020000
MS_PRIVATE = 1 << 18
MS_REC = 16384


def fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def seccomp_filter(pid: int) -> bytes:
    """The VMM's seccomp program (sock_filter array), read while it is stopped for a moment."""
    if libc.ptrace(PTRACE_SEIZE, pid, 0, 0) != 0:
        raise fail("PTRACE_SEIZE")
    try:
        libc.ptrace(PTRACE_INTERRUPT, pid, 0, 0)
        os.waitpid(pid, WALL)
        count = libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, None)
        if count <= 0:
            raise fail("PTRACE_SECCOMP_GET_FILTER")
        buf = ctypes.create_string_buffer(count * 8)
        libc.ptrace(PTRACE_SECCOMP_GET_FILTER, pid, 0, buf)
        return buf.raw
    finally:
        libc.ptrace(PTRACE_DETACH, pid, 0, 0)


def take_confinement(pid: int) -> None:
    program = seccomp_filter(pid)
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    uid = int(status["Uid"].split()[0])
    gid = int(status["Gid"].split()[0])
    pidfd = fcntl.fcntl(os.pidfd_open(pid), fcntl.F_DUPFD, 900)  # above the fds copied in
    for name in os.listdir(f"/proc/{pid}/fd"):
        fd = int(name)
        if fd > 2:
            copy = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
            if copy >= 0:
                os.dup2(copy, fd)
                os.close(copy)
    with open(f"/proc/{pid}/cgroup") as f:
        cgroups = f.read().splitlines()
    for line in cgroups:
        _, controllers, path = line.split(":", 2)
        if path == "/":
            continue
        if controllers:
            procs = f"/sys/fs/cgroup/{controllers.removeprefix('name=')}{path}/cgroup.procs"
        else:  # cgroup v2
            procs = f"/sys/fs/cgroup{path}/cgroup.procs"
        if os.path.exists(procs):
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
    for ns in ("net", "ipc", "uts", "mnt"):
        fd = os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY)
        if libc.setns(fd, 0) != 0:
            raise fail(f"setns {ns}")
        os.close(fd)
    os.chdir("/")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; past the last capability: EINVAL
    os.setresuid(uid, uid, uid)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise fail("no_new_privs")
    holder = ctypes.create_string_buffer(program)
    fprog = struct.pack("HxxxxxxQ", len(program) // 8, ctypes.addressof(holder))
    fbuf = ctypes.create_string_buffer(fprog)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        raise fail("install the VMM's seccomp filter")


# --- the attacks: each returns if it got what it tried, raises OSError if refused -----------


def read_file(p: dict) -> None:
    with open(p["path"], "rb") as f:
        f.read(4096)


def write_file(p: dict) -> None:
    # Opened for writing, never written: that the open succeeds is the breach.
    os.close(os.open(p["path"], os.O_WRONLY))


def connect_unix(p: dict) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(p["path"])
    s.close()


def connect_tcp(p: dict) -> None:
    # An address, never a name: inside the jail no codec or resolver module can be loaded.
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect((p["host"], p["port"]))
    s.close()


def read_proc(p: dict) -> None:
    with open(f"/proc/{p['pid']}/environ", "rb") as f:
        f.read()


def ptrace(p: dict) -> None:
    if libc.ptrace(PTRACE_SEIZE, p["pid"], 0, 0) != 0:
        raise fail("PTRACE_SEIZE")
    libc.ptrace(PTRACE_DETACH, p["pid"], 0, 0)


def exec_binary(p: dict) -> None:
    # What runs says so itself: this process is gone once exec works.
    os.execv("/bin/sh", ["sh", "-c", 'echo \'{"outcome": "done"}\''])


def mount(p: dict) -> None:
    if libc.unshare(CLONE_NEWNS) != 0:  # the control must not touch the host's mounts
        raise fail("unshare")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise fail("make / private")
    if libc.mount(b"drill", b"/tmp", b"tmpfs", 0, None) != 0:
        raise fail("mount")


def load_module(p: dict) -> None:
    fd = os.open("/dev/null", os.O_RDONLY)
    if libc.syscall(SYS_FINIT_MODULE, fd, b"", 0) != 0:
        err = ctypes.get_errno()
        # Past the permission check, an empty module is refused for what it is: the
        # caller could have loaded a real one.
        if err not in (errno.EPERM, errno.EACCES, errno.ENOSYS):
            return
        raise fail("finit_module")


def raise_privileges(p: dict) -> None:
    os.setresuid(0, 0, 0)
    if os.getuid() != 0:
        raise OSError(errno.EPERM, "still not root")


def threads(p: dict) -> None:
    """More threads than the VMM's pids limit (fork itself is one of the filter's kills)."""
    stop = threading.Event()
    started = 0
    try:
        for _ in range(p["count"]):
            threading.Thread(target=stop.wait, daemon=True).start()
            started += 1
    except RuntimeError as e:
        raise OSError(errno.EAGAIN, f"only {started} threads: {e}") from None
    finally:
        stop.set()


def allocate(p: dict) -> None:
    block = bytearray(p["bytes"])
    for i in range(0, len(block), 4096):
        block[i] = 1
    time.sleep(0.2)


ATTACKS: dict[str, Callable[[dict], None]] = {
    f.__name__: f
    for f in (
        read_file,
        write_file,
        connect_unix,
        connect_tcp,
        read_proc,
        ptrace,
        exec_binary,
        mount,
        load_module,
        raise_privileges,
        threads,
        allocate,
    )
}


def main() -> None:
    attack, params = ATTACKS[sys.argv[1]], json.loads(sys.argv[2])
    if len(sys.argv) > 4 and sys.argv[3] == "--as-vmm":
        take_confinement(int(sys.argv[4]))
    try:
        attack(params)
    except OSError as e:
        out = {"outcome": "refused", "errno": e.errno, "error": str(e)}
    else:
        out = {"outcome": "done"}
    os.write(1, (json.dumps(out) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()

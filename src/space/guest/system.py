"""The guest agent's duties as the VM's init: mounts, hostname, loopback, entropy, power."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import socket
import struct
from pathlib import Path

from . import protocol as p
from .common import log

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
SIOCADDRT = 0x890B
RTF_UP, RTF_GATEWAY = 0x1, 0x2
# Every sandbox's guest has the same address behind the same gateway (its own network namespace
# on the host), so snapshots restore anywhere; see space.worker.network.rules.
GUEST_IP, GUEST_NETMASK, GATEWAY_IP = "10.0.2.2", "255.255.255.252", "10.0.2.1"

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str = "") -> None:
    """mount(2); raises OSError."""
    args = (source.encode(), target.encode(), fstype.encode(), flags, data.encode())
    _check(_libc.mount(*args), target)


def umount2(target: str, flags: int = 0) -> None:
    """umount2(2); raises OSError."""
    _check(_libc.umount2(target.encode(), flags), target)


def syncfs(fd: int) -> None:
    """syncfs(2): flush the one file system `fd` is on; raises OSError."""
    _check(_libc.syncfs(fd), f"fd {fd}")


def _mount(source: str, target: str, fstype: str, options: str = "") -> None:
    os.makedirs(target, exist_ok=True)
    try:
        mount(source, target, fstype, 0, options)
    except OSError as e:
        if e.errno != errno.EBUSY:
            log(f"mount {fstype} on {target}: {e.strerror}")


def kernel_args() -> dict[str, str]:
    try:
        words = Path("/proc/cmdline").read_text().split()
    except OSError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def interface_up(name: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", name.encode(), 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", name.encode(), flags | IFF_UP))


def _sockaddr(address: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(address))


def configure_network(name: str = "eth0", resolv: Path = Path("/etc/resolv.conf")) -> bool:
    """Give the NIC, if the VM has one, the fixed guest address, a default route through the
    gateway and the gateway as resolver. False when there is no NIC."""
    if not Path(f"/sys/class/net/{name}").exists():
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifname = name.encode().ljust(16, b"\0")
        fcntl.ioctl(s, SIOCSIFADDR, ifname + _sockaddr(GUEST_IP))
        fcntl.ioctl(s, SIOCSIFNETMASK, ifname + _sockaddr(GUEST_NETMASK))
        interface_up(name)
        dev = ctypes.create_string_buffer(name.encode())
        # struct rtentry (x86-64): dst 0.0.0.0/0 via the gateway; the kernel reads 120 bytes.
        route = struct.pack(
            "@L16s16s16sHhLPhPLLH",
            0, _sockaddr("0.0.0.0"), _sockaddr(GATEWAY_IP), _sockaddr("0.0.0.0"),
            RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, ctypes.addressof(dev), 0, 0, 0,
        ).ljust(120, b"\0")  # fmt: skip
        with contextlib.suppress(FileExistsError):  # kept from before a snapshot
            fcntl.ioctl(s, SIOCADDRT, route)
    with contextlib.suppress(OSError):
        tmp = resolv.with_name(".resolv.conf.space")
        tmp.write_text(f"nameserver {GATEWAY_IP}\n")
        os.replace(tmp, resolv)
    return True


def init_system(args: dict[str, str]) -> None:
    """What a minimal init does before anything else runs."""
    os.environ.clear()
    os.environ.update({"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
    _mount("devpts", "/dev/pts", "devpts", "gid=5,mode=620,ptmxmode=666")
    _mount("tmpfs", "/dev/shm", "tmpfs", "mode=1777")
    os.makedirs("/tmp", mode=0o1777, exist_ok=True)
    socket.sethostname(args.get("space.hostname", "space"))
    try:
        interface_up("lo")
    except OSError as e:
        log(f"loopback: {e}")
    try:
        configure_network()
    except OSError as e:
        log(f"eth0: {e}")


def add_entropy(seed: bytes) -> None:
    """Mix host entropy into the kernel RNG and force a reseed so clones diverge at once."""
    with open("/dev/urandom", "wb") as f:
        info = struct.pack("ii", len(seed) * 8, len(seed)) + seed
        fcntl.ioctl(f.fileno(), RNDADDENTROPY, info)
        with contextlib.suppress(OSError):  # older kernels lack it; the add already reseeds
            fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)


def find_agent_port() -> str | None:
    for name_file in Path("/sys/class/virtio-ports").glob("*/name"):
        with contextlib.suppress(OSError):
            if name_file.read_text().strip() == p.AGENT_PORT_NAME:
                return f"/dev/{name_file.parent.name}"
    return None


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def power_off() -> None:
    _libc.reboot(0x4321FEDC)  # LINUX_REBOOT_CMD_POWER_OFF

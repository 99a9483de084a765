"""The platform's storage duties in the guest: flushing, volumes, the root file system's size.

Each is done here with system calls (sync(2), syncfs(2), mount(2), umount2(2), an ext4 ioctl)
and sysfs, never by running a program of the guest's: the tenant is root in there and may have
replaced any of them. What it could have changed under us (a symbolic link for a mount point,
a mount over one, a swapped device node) makes an operation fail with a clear error; every read
is bounded, and whatever can block runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import re
import stat
import struct
import time
from typing import TYPE_CHECKING, Any

from . import protocol as p
from . import reserve, system
from .common import Json, OpError, blocking, check_path, list_arg, os_error

if TYPE_CHECKING:
    from .agent import Connection

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
FITRIM = 0xC0185879  # _IOWR('X', 121, struct fstrim_range): discard a file system's free blocks
FIFREEZE = 0xC0045877  # _IOWR('X', 119, int): flush a file system, empty its journal, hold writes
FITHAW = 0xC0045878  # _IOWR('X', 120, int): let them go
UMOUNT_NOFOLLOW = 0x8
EXT4_IOC_RESIZE_FS = 0x40086610  # _IOW('f', 16, __u64): grow a mounted ext4 to n blocks
SECTOR = 512
MAX_TARGETS = 16
MAX_LAYERS = 8  # mounts stacked on one target that an unmount takes off, the volume last
MAX_DISKS = 1024  # entries of /sys/block looked at
DISK_WAIT_S = 10.0
END_WAIT_S = 10.0  # for killed processes to be gone (a process in D state takes its time)
POLL_S = 0.02
SYSFS_MAX = 4096
SERIAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,19}$")  # a virtio-blk serial: 20 bytes
VIRTIO_DEVICE = re.compile(r"^virtio[0-9]+$")
VIRTIO_BLK = "/sys/bus/virtio/drivers/virtio_blk"

_disks = asyncio.Lock()  # one volume mount (maybe a driver re-bind) at a time


# --- sync ------------------------------------------------------------------------------------


async def sync(conn: Connection, channel: int, req: Json) -> Json:
    """Everything to disk (sync(2)), or with `paths` only the file systems holding them."""
    if "paths" not in req:
        await blocking(os.sync)
        return {}
    paths = [check_path(x) for x in list_arg(req, "paths", MAX_TARGETS)]
    await blocking(_syncfs_all, paths)
    return {}


def _syncfs_all(paths: list[str]) -> None:
    for path in paths:
        _syncfs(path)


def _syncfs(path: str) -> None:
    fd = _open_dir(path)
    try:
        system.syncfs(fd)
    except OSError as e:
        raise os_error(e, path) from None
    finally:
        os.close(fd)


def _open_dir(path: str, flags: int = os.O_RDONLY) -> int:
    """The directory `path` itself, opened; a symbolic link there is refused, not followed."""
    try:
        return os.open(path, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise OpError(p.ErrorCode.INVALID, f"{path}: a symbolic link, refused") from None
        raise os_error(e, path) from None


# --- volumes ---------------------------------------------------------------------------------


async def mount_volumes(conn: Connection, channel: int, req: Json) -> Json:
    """Mount each {"serial", "target", "read_only"} in order; the first failure stops it.

    A volume is the virtio disk whose serial is `serial`. A VM restored from a snapshot whose
    guest saw an empty slot there (size 0) has its driver re-bound, so the guest probes the
    new disk. Read-only mounts skip the journal (`noload`): the device refuses its replay."""
    volumes = [_volume(v) for v in list_arg(req, "volumes", MAX_TARGETS)]
    targets = [os.path.normpath(target) for _, target, _ in volumes]
    if len(set(targets)) != len(targets) or len({s for s, _, _ in volumes}) != len(volumes):
        raise OpError(p.ErrorCode.INVALID, "each serial and each target may appear once")
    async with _disks:
        mounted = [await blocking(_mount_volume, *v) for v in volumes]
    return {"mounted": mounted}


def _volume(v: Any) -> tuple[str, str, bool]:
    if not isinstance(v, dict):
        raise OpError(p.ErrorCode.INVALID, "each volume is an object")
    serial, read_only = v.get("serial"), v.get("read_only", False)
    if not isinstance(serial, str) or not SERIAL.match(serial):
        raise OpError(p.ErrorCode.INVALID, f"'serial' must match {SERIAL.pattern}")
    target = check_path(v.get("target"), "target")
    if os.path.normpath(target) == "/":
        raise OpError(p.ErrorCode.INVALID, "a volume cannot be mounted on /")
    if not isinstance(read_only, bool):
        raise OpError(p.ErrorCode.INVALID, "'read_only' must be true or false")
    return serial, target, read_only


def _mount_volume(serial: str, target: str, read_only: bool) -> Json:
    disk = _find_disk(serial)
    if disk is None:
        raise OpError(p.ErrorCode.NOT_FOUND, f"volume {serial} is not attached")
    if _sectors(disk) == 0:
        _rebind(disk)
        disk = _wait_for_disk(serial)
    node = _device_node(disk)
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as e:
        raise os_error(e, target) from None
    fd = _open_dir(target, os.O_PATH)
    flags, data = (MS_RDONLY, "noload") if read_only else (0, "")
    try:
        # Through the descriptor: the directory checked above, whatever replaces the path.
        system.mount(node, f"/proc/self/fd/{fd}", "ext4", flags, data)
    except OSError as e:
        raise os_error(e, f"mounting volume {serial} ({node}) on {target}") from None
    finally:
        os.close(fd)
    return {"serial": serial, "target": target, "device": node, "read_only": read_only}


def _read_sysfs(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, SYSFS_MAX).decode(errors="replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def _write_sysfs(path: str, value: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)
    except OSError as e:
        raise os_error(e, f"writing {value} to {path}") from None


def _find_disk(serial: str) -> str | None:
    try:
        with os.scandir("/sys/block") as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_DISKS:
                    break
                name = entry.name
                if name.startswith("vd") and _read_sysfs(f"/sys/block/{name}/serial") == serial:
                    return name
    except OSError as e:
        raise os_error(e, "/sys/block") from None
    return None


def _sectors(disk: str) -> int:
    try:
        return int(_read_sysfs(f"/sys/block/{disk}/size"))
    except ValueError:
        return 0


def _rebind(disk: str) -> None:
    """The virtio_blk driver lets go of the disk's device and takes it again: a fresh probe."""
    device = os.path.basename(os.path.realpath(f"/sys/block/{disk}/device"))
    if not VIRTIO_DEVICE.match(device):
        raise OpError(p.ErrorCode.INVALID, f"{disk} is not a virtio disk (its device: {device})")
    _write_sysfs(f"{VIRTIO_BLK}/unbind", device)
    _write_sysfs(f"{VIRTIO_BLK}/bind", device)


def _wait_for_disk(serial: str) -> str:
    deadline = time.monotonic() + DISK_WAIT_S
    while True:
        disk = _find_disk(serial)
        if disk is not None and _sectors(disk) > 0:
            return disk
        if time.monotonic() > deadline:
            raise OpError(
                p.ErrorCode.NOT_FOUND,
                f"volume {serial} did not come back within {DISK_WAIT_S:g}s of its re-probe",
            )
        time.sleep(POLL_S)


def _device_node(disk: str) -> str:
    """/dev/<disk>, once it exists, if it is the disk's block device (not whatever the guest
    put there)."""
    try:
        major, minor = (int(x) for x in _read_sysfs(f"/sys/block/{disk}/dev").split(":"))
    except ValueError:
        raise OpError(p.ErrorCode.INTERNAL, f"{disk} has no device number") from None
    node = f"/dev/{disk}"
    deadline = time.monotonic() + DISK_WAIT_S
    while True:
        try:
            st = os.lstat(node)
            break
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise OpError(p.ErrorCode.NOT_FOUND, f"{node} did not appear") from None
            time.sleep(POLL_S)
        except OSError as e:
            raise os_error(e, node) from None
    if not stat.S_ISBLK(st.st_mode) or st.st_rdev != os.makedev(major, minor):
        raise OpError(p.ErrorCode.INVALID, f"{node} is not the block device {major}:{minor}")
    return node


async def unmount(conn: Connection, channel: int, req: Json) -> Json:
    """Flush and unmount each of `targets`, every mount stacked there; say which failed."""
    targets = [check_path(t, "target") for t in list_arg(req, "targets", MAX_TARGETS)]
    unmounted: list[str] = []
    failed: dict[str, Json] = {}
    for target in targets:
        try:
            await blocking(_unmount, target)
            unmounted.append(target)
        except OpError as e:
            failed[target] = {"code": str(e.code), "message": e.message}
    return {"unmounted": unmounted, "failed": failed}


def _unmount(target: str) -> None:
    for layer in range(MAX_LAYERS):
        _syncfs(target)  # what is mounted there now: left consistent even if it stays mounted
        try:
            system.umount2(target, UMOUNT_NOFOLLOW)
        except OSError as e:
            if e.errno == errno.EINVAL:  # nothing (more) is mounted there
                if layer:
                    return
                nothing = f"{target}: nothing is mounted there"
                raise OpError(p.ErrorCode.NOT_FOUND, nothing) from None
            raise os_error(e, target) from None
    raise OpError(p.ErrorCode.BUSY, f"{target}: more than {MAX_LAYERS} mounts stacked there")


# --- the root file system --------------------------------------------------------------------


async def grow_root_fs(conn: Connection, channel: int, req: Json) -> Json:
    """Grow the root ext4, mounted, to its disk's size (online resize; never shrinks).

    `min_size` (bytes): the disk the host just grew; the guest may learn of the new size a
    moment later, so this waits for it."""
    min_size = req.get("min_size", 0)
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
        raise OpError(p.ErrorCode.INVALID, "'min_size' must be a number of bytes")
    return await blocking(_grow_root, min_size)


def _grow_root(min_size: int) -> Json:
    fd = _open_dir("/")
    try:
        dev = os.fstat(fd).st_dev
        size_file = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/size"
        deadline = time.monotonic() + DISK_WAIT_S
        while True:
            try:
                disk_bytes = int(_read_sysfs(size_file)) * SECTOR
            except ValueError:
                raise OpError(p.ErrorCode.INTERNAL, f"{size_file}: no disk size") from None
            if disk_bytes >= min_size:
                break
            if time.monotonic() > deadline:
                raise OpError(
                    p.ErrorCode.INVALID,
                    f"the root disk is {disk_bytes} bytes, not the {min_size} expected",
                )
            time.sleep(POLL_S)
        before = os.fstatvfs(fd)
        blocks = disk_bytes // before.f_frsize
        try:
            fcntl.ioctl(fd, EXT4_IOC_RESIZE_FS, struct.pack("=Q", blocks))
        except OSError as e:
            if e.errno == errno.ENOTTY:
                raise OpError(p.ErrorCode.INVALID, "the root file system is not ext4") from None
            raise os_error(e, f"growing / to {blocks} blocks") from None
        after = os.fstatvfs(fd)
    finally:
        os.close(fd)
    return {
        "disk_bytes": disk_bytes,
        "block_size": after.f_frsize,
        "fs_bytes_before": before.f_blocks * before.f_frsize,
        "fs_bytes": after.f_blocks * after.f_frsize,
    }


async def seal_root_fs(conn: Connection, channel: int, req: Json) -> Json:
    """Leave the root file system small and clean before the VM stops (a template build):
    its free blocks discarded (with `trim`), everything flushed, then remounted read-only so it
    needs no journal replay. Best effort past the flush: the reply says what was done."""
    return await blocking(_seal_root, _trim_arg(req))


def _trim_arg(req: Json) -> bool:
    trim = req.get("trim", True)
    if not isinstance(trim, bool):
        raise OpError(p.ErrorCode.INVALID, "'trim' must be true or false")
    return trim


def _trim(fd: int) -> int | None:
    """Discard the free blocks of the file system of `fd`; how many bytes, or None where the
    disk cannot discard."""
    with contextlib.suppress(OSError):
        out = fcntl.ioctl(fd, FITRIM, struct.pack("=QQQ", 0, 2**64 - 1, 0))
        return int(struct.unpack("=QQQ", out)[1])
    return None


def _seal_root(trim: bool) -> Json:
    fd = _open_dir("/")
    try:
        trimmed = _trim(fd) if trim else None
        system.syncfs(fd)
    finally:
        os.close(fd)
    try:
        system.mount("none", "/", "", MS_REMOUNT | MS_RDONLY)
        read_only = True
    except OSError:  # something still has a file open for writing
        read_only = False
    os.sync()
    return {"trimmed_bytes": trimmed, "read_only": read_only}


async def freeze_root_fs(conn: Connection, channel: int, req: Json) -> Json:
    """Hold the root file system still and clean while the host copies its disk (a build step
    kept while its VM goes on to the next): its free blocks discarded (with `trim`), then
    frozen: flushed, its journal emptied, every write held until thaw_root_fs."""
    return await blocking(_freeze_root, _trim_arg(req))


def _freeze_root(trim: bool) -> Json:
    fd = _open_dir("/")
    try:
        trimmed = _trim(fd) if trim else None
        try:
            fcntl.ioctl(fd, FIFREEZE, 0)
        except OSError as e:
            raise os_error(e, "freezing /") from None
    finally:
        os.close(fd)
    return {"trimmed_bytes": trimmed}


async def thaw_root_fs(conn: Connection, channel: int, req: Json) -> Json:
    """Let the writes freeze_root_fs held go; `thawed` is false if / was not frozen."""
    return await blocking(_thaw_root)


def _thaw_root() -> Json:
    fd = _open_dir("/")
    try:
        fcntl.ioctl(fd, FITHAW, 0)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise os_error(e, "thawing /") from None
        return {"thawed": False}
    finally:
        os.close(fd)
    return {"thawed": True}


async def end_processes(conn: Connection, channel: int, req: Json) -> Json:
    """Kill every process the agent started and all they started (a build step's daemons), so
    that nothing runs on into what comes next; `ended` is false if some outlived the wait."""
    return {"ended": await blocking(reserve.end_all, END_WAIT_S)}

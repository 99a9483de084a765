"""Running Firecracker inside its `jailer`: the command line and the chroot it works in.

The jailer (shipped with Firecracker) creates `<chroot-base>/<exec-file-name>/<id>/root`,
pivots into it, applies cgroups and resource limits, drops to an unprivileged uid/gid and
execs Firecracker. Everything Firecracker opens must therefore already be inside that
directory, and every path given to its API is relative to the chroot. This module builds the
`jailer` argv (`jailer_argv`), computes the layout (`chroot_root`, `jail_dir`) and puts files
into the jail (`place_file`): hard links where possible, otherwise a reflink or a copy.

`clone_file` (reflink, else a sparse-aware full copy) lives here too, since placing files in
the jail needs it; the driver reuses it to copy a VM's disk into a snapshot.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from space.worker.vmm.base import VMMError

log = logging.getLogger(__name__)

DEFAULT_CHROOT_BASE = Path("/srv/jailer")
JAILED_API_SOCKET = "/run/firecracker.socket"  # Firecracker's default; the jailer creates /run
CGROUP2_MOUNT = Path("/sys/fs/cgroup")
MAX_INSTANCE_ID_LEN = 64
RESOURCE_LIMITS = frozenset({"fsize", "no-file"})  # the only two the jailer knows

_INSTANCE_ID = re.compile(r"[A-Za-z0-9-]+")
_CGROUP_FILE = re.compile(r"[a-z0-9_]+\.[a-z0-9_.]+")
_FICLONE = 0x40049409  # ioctl number from <linux/fs.h>; not exported by Python 3.11's fcntl

CopyMethod = Literal["hardlink", "reflink", "copy"]


class JailerError(VMMError):
    """The jailer configuration is invalid, or the jail could not be prepared."""


class InvalidInstanceIdError(JailerError):
    """An id that Firecracker and its jailer would refuse."""


def validate_instance_id(instance_id: str) -> None:
    """Refuse ids the jailer (and Firecracker's `--id`) reject: 1-64 of [A-Za-z0-9-].

    Firecracker accepts Unicode letters too; we allow only ASCII because the id also
    becomes a directory name and a cgroup name.
    """
    if not 1 <= len(instance_id) <= MAX_INSTANCE_ID_LEN:
        raise InvalidInstanceIdError(
            f"invalid Firecracker instance id {instance_id!r}: it must be 1 to "
            f"{MAX_INSTANCE_ID_LEN} characters long (got {len(instance_id)})"
        )
    if not _INSTANCE_ID.fullmatch(instance_id):
        bad = sorted({c for c in instance_id if not _INSTANCE_ID.fullmatch(c)})
        raise InvalidInstanceIdError(
            f"invalid Firecracker instance id {instance_id!r}: only ASCII letters, digits and "
            f"'-' are allowed (found {''.join(bad)!r})"
        )


@dataclass(frozen=True)
class JailerConfig:
    """How to jail one Firecracker process. Validated on creation.

    `cgroups` maps a cgroup file to its value, e.g. `{"cpu.max": "50000 100000",
    "memory.max": "536870912"}`; `resource_limits` maps `fsize` / `no-file` to a number.
    With `daemonize` the jailer calls setsid() itself and sends Firecracker's stdio to
    /dev/null (so the serial console must then go to a file via the API).
    """

    id: str
    firecracker_binary: Path | str
    uid: int
    gid: int
    jailer_binary: Path | str = "jailer"
    chroot_base_dir: Path = DEFAULT_CHROOT_BASE
    netns: Path | None = None
    cgroup_version: int = 2
    cgroups: Mapping[str, str] = field(default_factory=dict)
    parent_cgroup: str | None = None
    resource_limits: Mapping[str, int] = field(default_factory=dict)
    daemonize: bool = False

    def __post_init__(self) -> None:
        validate_instance_id(self.id)
        for name, value in (("uid", self.uid), ("gid", self.gid)):
            if not isinstance(value, int) or value < 0:
                raise JailerError(f"jailer {name} must be a non-negative integer, got {value!r}")
        if self.cgroup_version not in (1, 2):
            raise JailerError(f"cgroup_version must be 1 or 2, got {self.cgroup_version!r}")
        for key, cg_value in self.cgroups.items():
            if not _CGROUP_FILE.fullmatch(key):
                raise JailerError(
                    f"invalid cgroup file {key!r}: expected <controller>.<property>, "
                    "e.g. 'cpu.max' or 'memory.max'"
                )
            # The jailer splits `--cgroup k=v` on every '=' and wants exactly two parts.
            if not cg_value or "=" in cg_value or "\n" in cg_value:
                raise JailerError(
                    f"invalid value {cg_value!r} for cgroup {key!r}: it must be non-empty and "
                    "contain no '=' or newline"
                )
        for key, limit in self.resource_limits.items():
            if key not in RESOURCE_LIMITS:
                raise JailerError(
                    f"unknown resource limit {key!r}: the jailer knows only "
                    f"{', '.join(sorted(RESOURCE_LIMITS))}"
                )
            if not isinstance(limit, int) or limit < 0:
                raise JailerError(f"resource limit {key} must be a non-negative integer")
        if self.parent_cgroup is not None:
            parts = PurePosixPath(self.parent_cgroup).parts
            if not parts or self.parent_cgroup.startswith("/") or {".", ".."} & set(parts):
                raise JailerError(
                    f"invalid parent cgroup {self.parent_cgroup!r}: it must be a relative path "
                    "without '.' or '..'"
                )

    def exec_file(self) -> Path:
        """The Firecracker binary as the jailer will see it: absolute, symlinks resolved."""
        found = _which(self.firecracker_binary)
        if found is None:
            raise JailerError(
                f"Firecracker binary {str(self.firecracker_binary)!r} not found; install "
                "Firecracker or pass its full path"
            )
        resolved = found.resolve()
        # Current jailers refuse an exec file whose name does not contain "firecracker".
        if "firecracker" not in resolved.name:
            raise JailerError(
                f"the jailer only execs a file whose name contains 'firecracker'; "
                f"{resolved} does not"
            )
        return resolved

    def jailer_file(self) -> Path:
        found = _which(self.jailer_binary)
        if found is None:
            raise JailerError(
                f"jailer binary {str(self.jailer_binary)!r} not found; it ships with "
                "Firecracker — install it or pass its full path"
            )
        return found


def _which(binary: Path | str) -> Path | None:
    text = str(binary)
    if "/" in text:
        path = Path(text)
        return path if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which(text)
    return Path(found) if found else None


def jail_dir(config: JailerConfig) -> Path:
    """`<chroot-base>/<exec-file-name>/<id>`: the directory owned by this one jailed VM."""
    # The jailer canonicalizes both the base dir and the exec file before joining them.
    return config.chroot_base_dir.resolve() / config.exec_file().name / config.id


def chroot_root(config: JailerConfig) -> Path:
    """The directory Firecracker sees as `/`."""
    return jail_dir(config) / "root"


def cgroup_dir(config: JailerConfig) -> Path | None:
    """The cgroup v2 directory the jailer creates for this VM (it never removes it itself)."""
    if config.cgroup_version != 2 or not config.cgroups:
        return None
    parent = config.parent_cgroup or config.exec_file().name
    return CGROUP2_MOUNT / parent / config.id


def jailer_argv(
    config: JailerConfig,
    firecracker_args: Sequence[str] = (),
    *,
    api_sock: str = JAILED_API_SOCKET,
) -> list[str]:
    """The full `jailer … -- --api-sock … <firecracker_args>` command line.

    The jailer passes `--id` to Firecracker itself, so `firecracker_args` must not.
    """
    if "--id" in firecracker_args:
        raise JailerError("the jailer passes --id to Firecracker itself; do not repeat it")
    argv = [
        str(config.jailer_file()),
        "--id",
        config.id,
        "--exec-file",
        str(config.exec_file()),
        "--uid",
        str(config.uid),
        "--gid",
        str(config.gid),
        "--chroot-base-dir",
        str(config.chroot_base_dir.resolve()),
        "--cgroup-version",
        str(config.cgroup_version),
    ]
    if config.parent_cgroup is not None:
        argv += ["--parent-cgroup", config.parent_cgroup]
    if config.netns is not None:
        argv += ["--netns", str(config.netns)]
    for key, value in config.cgroups.items():
        argv += ["--cgroup", f"{key}={value}"]
    for key, limit in config.resource_limits.items():
        argv += ["--resource-limit", f"{key}={limit}"]
    if config.daemonize:
        argv.append("--daemonize")
    return [*argv, "--", "--api-sock", api_sock, *firecracker_args]


@dataclass(frozen=True)
class PlacedFile:
    """A file put into the jail: where it is on the host, its name inside, and how it got there."""

    host_path: Path
    jailed_path: str
    method: CopyMethod


def prepare_jail(config: JailerConfig) -> Path:
    """Create the chroot root for a new VM and return it; refuse to reuse a stale jail.

    The jailer itself fails on a leftover jail (it mknods /dev/kvm there), so a leftover
    means a VM with this id still runs or was not cleaned up — both need a human decision.
    """
    directory = jail_dir(config)
    if directory.exists():
        raise JailerError(
            f"jail directory {directory} already exists: a VM with id {config.id!r} is still "
            "running or was not cleaned up"
        )
    root = directory / "root"
    root.mkdir(parents=True, mode=0o755)
    return root


def place_file(config: JailerConfig, source: Path, name: str, *, writable: bool) -> PlacedFile:
    """Make `source` available inside the jail as `/<name>`, readable (or writable) by the VM.

    Writable files (the VM's disk) are hard-linked and chown'd to the jail's uid/gid: the
    guest must write to the caller's file itself, so a copy is refused with a clear error.
    Read-only files (kernel, initrd, snapshot state) are hard-linked when they are already
    world-readable; chowning a shared inode would hand a template's kernel to this VM's uid.
    Otherwise (another file system, or not readable) they are reflinked or copied, and the
    copy is chown'd.
    """
    if "/" in name or name in ("", ".", ".."):
        raise JailerError(f"jailed file name {name!r} must be a plain file name")
    target = chroot_root(config) / name
    source = source.resolve()
    if not source.is_file():
        raise JailerError(f"cannot put {source} into the jail: it is not a file")
    world_readable = bool(source.stat().st_mode & stat.S_IROTH)
    if writable or world_readable:
        try:
            os.link(source, target)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise JailerError(f"cannot hard-link {source} to {target}: {exc}") from exc
            if writable:
                raise JailerError(
                    f"cannot hard-link the VM's disk {source} into the jail {target.parent} "
                    f"({exc.strerror}); a copy would make the guest write to the copy. Put the "
                    "chroot base directory on the same file system as the disks."
                ) from exc
        else:
            if writable:
                os.chown(target, config.uid, config.gid)
            return PlacedFile(target, "/" + name, "hardlink")
    method = clone_file(source, target)
    if method == "copy":
        log.warning(
            "copied %s into jail %s in full (no hard link or reflink possible)", source, target
        )
    os.chown(target, config.uid, config.gid)
    return PlacedFile(target, "/" + name, method)


def clone_file(source: Path, dest: Path) -> CopyMethod:
    """Copy `source` to a new file `dest`: a reflink where the file system allows, else a copy.

    The full copy keeps holes (sparse disk images stay sparse). Returns which one happened,
    so callers can say when they fell back to a full copy.
    """
    with open(source, "rb") as src, open(dest, "xb") as dst:
        try:
            fcntl.ioctl(dst.fileno(), _FICLONE, src.fileno())
        except OSError as exc:
            if exc.errno not in (
                errno.EOPNOTSUPP,
                errno.ENOTTY,
                errno.EXDEV,
                errno.EINVAL,
                errno.ENOSYS,
                errno.EPERM,
            ):
                raise
        else:
            return "reflink"
        _sparse_copy(src.fileno(), dst.fileno(), os.fstat(src.fileno()).st_size)
    shutil.copymode(source, dest)
    return "copy"


def _sparse_copy(src: int, dst: int, size: int) -> None:
    offset = 0
    while offset < size:
        try:
            data = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # only a hole remains
                break
            raise
        hole = os.lseek(src, data, os.SEEK_HOLE)
        _copy_range(src, dst, data, hole - data)
        offset = hole
    os.ftruncate(dst, size)


def _copy_range(src: int, dst: int, offset: int, count: int) -> None:
    end = offset + count
    while offset < end:
        try:
            done = os.copy_file_range(src, dst, end - offset, offset, offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            done = 0
        if done == 0:  # not supported here (or EOF): plain reads and writes
            chunk = os.pread(src, min(end - offset, 1 << 20), offset)
            if not chunk:
                return
            done = os.pwrite(dst, chunk, offset)
        offset += done

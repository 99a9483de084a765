"""The VMM driver interface: what a worker asks of any hypervisor.

A `Driver` turns a `VMConfig` into a running `VM` (cold boot) or restores one from a snapshot
directory. A `VM` object owns one VMM process and everything made for it (its run directory,
sockets, console log) and releases all of it in `close()`. Drivers differ only in how they
talk to the hypervisor; the guest agent is reached through `VM.open_agent_stream()` whatever
the transport underneath (virtio-serial under QEMU, hybrid vsock under Firecracker).
"""

from __future__ import annotations

import abc
import asyncio
import enum
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from space.settings import Shares
from space.worker import formats

SNAPSHOT_MANIFEST = "snapshot.json"
SNAPSHOT_DISK = "disk.img"
# Guest RAM as a file: a snapshot source's own in its run directory, then its snapshot's.
MEMORY_FILE = "memory.bin"


class VMMError(Exception):
    """A hypervisor operation failed; the message says which and why."""


class VMStateError(VMMError):
    """The operation is not allowed in the VM's current state."""


class VMGone(VMMError):
    """The VMM process has exited; the VM cannot be used any more."""


class VMMUnresponsive(VMMError, TimeoutError):
    """The VMM did not answer within its deadline; it may yet."""


class VMState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"  # ended on request
    CRASHED = "crashed"  # the VMM process died on its own or was killed


@dataclass(frozen=True)
class Drive:
    """A disk besides the root one: a volume, or an empty slot one can be put in at restore.

    The guest finds it by `serial` (/sys/block/vd*/serial), not by its order."""

    path: Path
    serial: str
    read_only: bool = False
    # An empty slot: a zero-length file many VMs share, so the VMM must not lock it.
    placeholder: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "serial": self.serial, "read_only": self.read_only,
                "placeholder": self.placeholder}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Drive:
        return cls(Path(data["path"]), str(data["serial"]), bool(data.get("read_only", False)),
                   bool(data.get("placeholder", False)))  # fmt: skip


@dataclass(frozen=True)
class VMConfig:
    """Everything needed to boot a VM. Saved with snapshots, so restores match exactly."""

    vm_id: str
    kernel: Path
    rootfs: Path
    initrd: Path | None = None
    vcpus: int = 1
    memory_mib: int = 256
    hostname: str = "space"
    agent_token: str = ""
    extra_cmdline: str = ""
    tap_device: str | None = None
    guest_mac: str | None = None
    drives: tuple[Drive, ...] = ()
    # A NIC on a tap the caller opened (in the sandbox's network namespace): the fd is this
    # process's, good for one launch, and never saved; `nic` says the machine has the device.
    tap_fd: int | None = field(default=None, compare=False)
    nic: bool = False
    # A virtio-balloon that only reports the pages the guest frees, so the host takes them
    # back (free page reporting); the driver sets it at boot, snapshots keep what they had.
    free_page_reporting: bool = False
    # Guest RAM in this file rather than anonymous memory. Shared, the VM writes into it and a
    # snapshot keeps the file as it is (base snapshots); private, the VM reads it on demand and
    # keeps what it writes to itself (restores of such snapshots).
    memory_file: Path | None = None
    memory_shared: bool = False

    @property
    def has_nic(self) -> bool:
        return self.nic or self.tap_device is not None

    def kernel_cmdline(self, console: str) -> str:
        parts = [
            f"console={console}",
            "root=/dev/vda",
            "rootfstype=ext4",
            "rw",
            "quiet",
            "panic=-1",
            f"space.hostname={self.hostname}",
            f"space.token={self.agent_token}",
        ]
        if self.extra_cmdline:
            parts.append(self.extra_cmdline)
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("kernel", "rootfs", "initrd", "memory_file"):
            if data[key] is not None:
                data[key] = str(data[key])
        data["drives"] = [d.to_json() for d in self.drives]
        del data["tap_fd"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VMConfig:
        data = dict(data)
        for key in ("kernel", "rootfs", "initrd", "memory_file"):
            if data.get(key) is not None:
                data[key] = Path(data[key])
        data["drives"] = tuple(Drive.from_json(d) for d in data.get("drives", ()))
        return cls(**data)

    def with_changes(self, **changes: Any) -> VMConfig:
        return replace(self, **changes)


@dataclass(frozen=True)
class VMStatus:
    state: VMState
    pid: int | None
    reason: str | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class SnapshotInfo:
    """A snapshot directory: device and memory state, the disk as it was, and the config."""

    path: Path
    driver: str
    config: VMConfig
    files: dict[str, str] = field(default_factory=dict)  # role -> file name inside `path`
    took_s: float = 0.0
    # How long the guest was stopped for it: all of `took_s`, unless it was taken live.
    downtime_s: float = 0.0

    def size_bytes(self) -> int:
        """Bytes actually allocated on disk (sparse files and zero pages count as nothing)."""
        return sum((self.path / name).stat().st_blocks * 512 for name in self.files.values())

    def save(self) -> None:
        manifest = {
            "driver": self.driver,
            "config": self.config.to_json(),
            "files": self.files,
            "took_s": self.took_s,
            "downtime_s": self.downtime_s,
        }
        tmp = self.path / (SNAPSHOT_MANIFEST + ".tmp")
        tmp.write_text(json.dumps(formats.stamp("snapshot", manifest), indent=2))
        tmp.chmod(0o600)  # holds the agent token
        tmp.replace(self.path / SNAPSHOT_MANIFEST)

    @classmethod
    def load(cls, path: Path) -> SnapshotInfo:
        manifest_path = path / SNAPSHOT_MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise VMMError(f"{path} is not a snapshot: {SNAPSHOT_MANIFEST} is missing") from None
        try:
            formats.check("snapshot", manifest, manifest_path)
        except formats.FormatError as e:
            raise VMMError(str(e)) from None
        for name in manifest["files"].values():
            # Names inside its own directory only: a snapshot may come from another host.
            if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                raise VMMError(f"{path}: {SNAPSHOT_MANIFEST} names a file outside it: {name!r}")
        return cls(
            path=path,
            driver=manifest["driver"],
            config=VMConfig.from_json(manifest["config"]),
            files=manifest["files"],
            took_s=manifest.get("took_s", 0.0),
            downtime_s=manifest.get("downtime_s", 0.0),
        )


class VM(abc.ABC):
    """One running VM and the VMM process behind it."""

    config: VMConfig
    run_dir: Path

    @property
    def id(self) -> str:
        return self.config.vm_id

    @abc.abstractmethod
    def status(self) -> VMStatus: ...

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop the vCPUs; memory stays, resume is immediate."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def snapshot(self, dest: Path) -> SnapshotInfo:
        """Save memory, device state and the disk into `dest`. The VM is left paused."""

    async def snapshot_live(self, dest: Path) -> SnapshotInfo:
        """A snapshot like `snapshot`'s, copying memory while the guest runs on and stopping it
        only for the last of it, where the VMM can (`downtime_s` says how long). The VM is left
        paused. Drivers that cannot pause first."""
        return await self.snapshot(dest)

    @abc.abstractmethod
    async def stop(self, timeout: float = 5.0) -> VMStatus:
        """End the VM (gracefully where the VMM allows, else by force) and release everything."""

    @abc.abstractmethod
    async def kill(self) -> VMStatus:
        """End the VMM process at once and release everything."""

    @abc.abstractmethod
    async def wait(self) -> VMStatus:
        """Wait until the VMM process exits, for whatever reason."""

    @abc.abstractmethod
    async def open_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A fresh byte stream to the guest agent (not yet authenticated)."""

    @property
    @abc.abstractmethod
    def console_log(self) -> Path: ...

    def save(self) -> None:  # noqa: B027 - an optional hook, empty by default
        """Persist what a restarted worker needs to adopt this VM (drivers that can adopt)."""

    async def detach(self) -> None:
        """Let go of the VM, leaving it running for another process to adopt."""
        raise VMMError(f"{type(self).__name__} cannot hand its VM over")

    async def answering(self, timeout: float) -> None:
        """Return once the VMM has answered a question about its state, within `timeout`;
        VMMUnresponsive if it did not (frozen, stopped by a signal, wedged)."""
        if self.status().state not in (VMState.RUNNING, VMState.PAUSED, VMState.STARTING):
            raise VMGone(f"VM {self.id} is {self.status().state}")

    async def continue_after_io_error(self) -> None:
        """Run a guest the VMM stopped on a write error (e.g. a full disk) again."""
        raise VMMError(f"{type(self).__name__} cannot continue after an I/O error")

    async def resize_disk(self, size_bytes: int) -> None:
        """Grow the root disk while the VM runs; the guest sees the new size at once."""
        raise VMMError(f"{type(self).__name__} cannot resize disks")

    def console_text(self) -> str:
        try:
            return self.console_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def close(self) -> None:
        """Release the VM whatever its state: kill it if still there, remove its files."""
        if self.status().state not in (VMState.STOPPED, VMState.CRASHED):
            await self.kill()

    async def __aenter__(self) -> VM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Driver(abc.ABC):
    """Makes VMs with one kind of hypervisor."""

    name: str
    # Give guests booted from now on the free-page-reporting balloon (VMConfig.free_page_reporting).
    free_page_reporting: bool = False
    # Boot snapshot sources with their RAM in a file, which their snapshots keep and restores
    # map (VMConfig.memory_file); otherwise such a config's file is ignored.
    mapped_memory: bool = False
    # What each VM may take of the host's disk (its drives together); None: no limit.
    shares: Shares | None = None

    @property
    def shares_snapshot_memory(self) -> bool:
        """Whether clones of a snapshot map its memory file itself (sharing its pages), rather
        than a copy of their own."""
        return True

    @abc.abstractmethod
    async def boot(self, config: VMConfig, run_dir: Path) -> VM:
        """Cold-boot `config`; returns once the VMM process is up (not the guest)."""

    @abc.abstractmethod
    async def restore(
        self, snapshot: SnapshotInfo, config: VMConfig, run_dir: Path, *, paused: bool = False
    ) -> VM:
        """Start a VM from `snapshot`, with `config.rootfs` already a copy of the snapshot's disk.

        `config` must match the snapshot's machine (vCPUs, memory, devices); only the identity
        (`vm_id`, `rootfs`, network device) may differ. With `paused` the guest is loaded but
        its vCPUs wait for `resume()`, so the caller can retire the snapshot before the guest
        makes it stale.
        """

    async def adopt(self, run_dir: Path) -> VM:
        """Take over a VM a previous worker process started, found by its run directory."""
        raise VMMError(f"the {self.name} driver cannot adopt VMs another process started")

    async def probe(self, vm: VM, timeout: float) -> str:
        """The VMM's own word on the guest within `timeout` ("running", "paused", "io-error",
        …); TimeoutError if it does not answer."""
        state = vm.status().state
        return "running" if state in (VMState.RUNNING, VMState.STARTING) else str(state)

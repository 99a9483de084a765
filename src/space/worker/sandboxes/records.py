"""What a worker keeps about its sandboxes, in memory and on disk, and where it keeps it.

Everything lives under `<pool>/workers/<worker_id>/` (`Layout`):

    vms/<id>/          run directory of a VM: its disk, sockets, vm.json, sandbox.json
    suspended/<id>/    snapshot of a suspended sandbox (memory, devices, disk) and sandbox.json
    base/<template>-<vcpus>-<memory>/   the base snapshot every create of that shape restores
    building/<id>/     the VM a base snapshot is being taken of
    checkpoints/<id>/<checkpoint>/   a sandbox's checkpoints (memory, devices, disk)

Each step that changes which copy of a sandbox is authoritative is one rename, made after what
it publishes is on disk (`write_durable`, `fsync_tree`), so a crash at any instruction leaves
exactly one copy to go on from.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from space.worker import formats
from space.worker.machine import Machine
from space.worker.sandboxes.errors import WrongState
from space.worker.vmm.base import VMState

SANDBOX_FILE = "sandbox.json"
EMPTY_SLOT = "empty-slot.img"
LOCK_FILE = "worker.lock"
EPOCH_FILE = "epoch"
UNREADABLE = (OSError, ValueError, KeyError, TypeError)  # what a damaged sandbox.json raises

Condition = Literal["live", "suspended", "crashed", "unresponsive"]


@dataclass(frozen=True)
class Layout:
    root: Path  # <pool>/workers/<worker_id>
    pool_root: Path

    @property
    def vms(self) -> Path:
        return self.root / "vms"

    @property
    def suspended(self) -> Path:
        return self.root / "suspended"

    @property
    def base(self) -> Path:
        return self.root / "base"

    @property
    def building(self) -> Path:
        return self.root / "building"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def volumes(self) -> Path:
        # Volumes outlive sandboxes and worker ids: they belong to the host's pool.
        return self.pool_root / "volumes"

    @property
    def empty_slot(self) -> Path:
        return self.root / EMPTY_SLOT

    def make(self) -> None:
        for d in (self.vms, self.suspended, self.base, self.building, self.checkpoints,
                  self.volumes):  # fmt: skip
            d.mkdir(parents=True, exist_ok=True)
        self.empty_slot.touch(mode=0o600)


@dataclass(frozen=True)
class VolumeMount:
    """A volume in a sandbox: its image's id and size, where the guest mounts it, and how."""

    id: str
    size_mib: int
    path: str
    read_only: bool = False


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox was created with; kept next to its VM and its suspended snapshot."""

    template: str
    vcpus: int
    memory_mib: int
    env: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    disk_mib: int = 0  # 0: the template image's own size
    volumes: tuple[VolumeMount, ...] = ()
    # How the template runs processes, unless an exec says otherwise.
    template_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxSpec:
        volumes = tuple(VolumeMount(**v) for v in data.get("volumes", ()))
        return cls(**{**data, "volumes": volumes})


@dataclass
class SandboxVM:
    """One sandbox on this worker. `machine` is its VM while one exists; without one it is
    suspended (a snapshot on disk), crashed (its disk is kept for a reboot) or unresponsive
    (its VMM is there but did not answer; it is retried, never killed for it)."""

    id: str
    spec: SandboxSpec
    machine: Machine | None
    boot: str  # how it came to run: "restore", "cold", "fork", or "reboot" (from its disk)
    took_ms: float
    condition: Condition = "live"
    why: str | None = None  # what is wrong, while crashed or unresponsive
    reboots: int = 0
    since: float = field(default_factory=time.monotonic)  # created or adopted at
    # Its VMM is being replaced by a restore of one of its checkpoints (a rollback): it is
    # running as far as anyone asks, and calls that need its VM wait for its lock meanwhile.
    replacing: bool = False
    # Where its snapshot is in the registry while suspended (pushed by this worker process).
    artifact: str | None = None

    @property
    def state(self) -> str:
        """running, paused, suspended, error (its VMM died, or an I/O error stopped it), or
        unresponsive."""
        if self.replacing:
            return "running"
        if self.condition in ("suspended", "unresponsive"):
            return self.condition
        if self.machine is None:
            return "error"
        vm_state = self.machine.status().state
        if self.machine.io_error is not None:
            return "error"
        if vm_state == VMState.PAUSED:
            return "paused"
        if vm_state in (VMState.RUNNING, VMState.STARTING):
            return "running" if not self.machine.unresponsive else "unresponsive"
        return "error"

    @property
    def reason(self) -> str | None:
        state = self.state
        if state not in ("error", "unresponsive"):
            return None
        if self.machine is not None:
            if self.machine.io_error is not None:
                return f"paused by an I/O error: {self.machine.io_error}"
            if self.machine.unresponsive:
                return "its VMM does not answer"
            if self.why is None:
                return self.machine.status().reason or "the VM stopped"
        return self.why

    @property
    def crashed(self) -> bool:
        """Its VMM is gone but its disk is here: a create boots it again from that disk."""
        if self.replacing:
            return False
        if self.condition == "crashed":
            return True
        return (
            self.machine is not None
            and self.condition == "live"
            and self.machine.status().state in (VMState.CRASHED, VMState.STOPPED)
        )

    def live_machine(self, verb: str) -> Machine:
        """Its VM, for an operation that needs one that is there and answers."""
        if self.machine is None or self.condition != "live" or self.crashed:
            raise WrongState(f"cannot {verb} VM {self.id}: it is {self.state}", self.state)
        return self.machine

    def save(self, directory: Path) -> None:
        record = {"spec": asdict(self.spec), "boot": self.boot, "took_ms": self.took_ms,
                  "reboots": self.reboots}  # fmt: skip
        write_durable(directory / SANDBOX_FILE, json.dumps(formats.stamp("sandbox", record)))

    @classmethod
    def load(cls, vm_id: str, directory: Path, machine: Machine | None) -> SandboxVM:
        record = json.loads((directory / SANDBOX_FILE).read_text())
        formats.check("sandbox", record, directory / SANDBOX_FILE)
        spec = SandboxSpec.from_json(record["spec"])
        return cls(vm_id, spec, machine, str(record["boot"]), float(record["took_ms"]),
                   reboots=int(record.get("reboots", 0)))  # fmt: skip


def write_durable(path: Path, text: str | bytes, mode: int = 0o600) -> None:
    """Write a file so that after a crash it is either the old one or the whole new one."""
    data = text.encode() if isinstance(text, str) else text
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Every file under `directory`, then the directories themselves, on disk."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(Path(dirpath))


def rename_durable(source: Path, dest: Path) -> None:
    """One atomic step: `source` becomes `dest`, and stays so after a crash."""
    source.rename(dest)
    fsync_dir(dest.parent)
    if source.parent != dest.parent:
        fsync_dir(source.parent)

"""Jails for VMMs: an unprivileged uid of each VM's own, no capabilities, `no_new_privs`, a mount
namespace whose root holds only that VM's files, its sandbox's network namespace, a cgroup of
its own and the VMM's seccomp filter (`launch.py` does it, between fork and exec).

`Jail.confine` leases the uid and makes the cgroup for one VMM and says how to launch it;
`Jail.release` gives both back once the VMM is gone.
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from space.settings import JailSettings
from space.worker.vmm.base import VMConfig
from space.worker.vmm.firecracker.jailer import JailerConfig
from space.worker.vmm.jail import launch
from space.worker.vmm.jail.cgroups import PARENT, CgroupError, Cgroups, Limits
from space.worker.vmm.jail.launch import JailSpec
from space.worker.vmm.jail.uids import UidRange
from space.worker.vmm.process import VMM_NICE

log = logging.getLogger(__name__)

ROOT_MOUNTPOINT = Path("/run/space/jail")
LAUNCHER = Path(launch.__file__)


@dataclass(frozen=True)
class Confinement:
    """One VMM's jail: what launches it, and what is given back when it is gone."""

    uid: int
    cgroup: str
    spec: JailSpec

    def command(self, argv: list[str]) -> list[str]:
        """The command line that starts `argv` in this jail."""
        return [sys.executable, "-E", "-s", "-S", str(LAUNCHER), self.spec.to_json(), *argv]

    def record(self) -> dict[str, Any]:
        return {"uid": self.uid, "cgroup": self.cgroup}


class Jail:
    def __init__(self, settings: JailSettings, cgroups: Cgroups | None = None) -> None:
        self.settings = settings
        self.uids = UidRange(settings.uid_base, settings.uid_count)
        self.cgroups = cgroups or Cgroups()
        ROOT_MOUNTPOINT.mkdir(parents=True, exist_ok=True)
        self.cgroups.sweep()

    def limits(self, vcpus: int, memory_mib: int) -> Limits:
        s = self.settings
        return Limits(
            # Twice the guest's RAM: the page cache of a snapshot stream QEMU writes or reads
            # (as big as the guest's RAM) is charged here too, and a cgroup short of room for it
            # stalls its VMM in writeback.
            memory_bytes=(2 * memory_mib + s.memory_overhead_mib) << 20,
            pids=s.pids,
            cpus=vcpus + s.extra_cpus,
            weight=100 * vcpus,
        )

    def confine(
        self,
        vm_id: str,
        *,
        exe: str,
        vcpus: int,
        memory_mib: int,
        read_only: list[Path],
        writable: list[Path],
        devices: list[str],
        tap_fd: int | None,
    ) -> Confinement:
        uid = self.uids.lease(vm_id)
        name = f"vm-{vm_id}-{secrets.token_hex(3)}"
        try:
            procs = self.cgroups.create(name, self.limits(vcpus, memory_mib))
        except CgroupError:
            self.uids.release(uid)
            raise
        spec = JailSpec(
            uid=uid, gid=uid, root=str(ROOT_MOUNTPOINT), exe=exe, tap_fd=tap_fd, cgroups=procs,
            read_only=[str(p) for p in read_only],
            writable=[str(p) for p in writable], devices=devices, nice=VMM_NICE,
        )  # fmt: skip
        return Confinement(uid, name, spec)

    def firecracker(
        self, binary: str, chroot_base: Path
    ) -> tuple[Callable[[VMConfig], JailerConfig], Callable[[JailerConfig], None]]:
        """Firecracker's own jailer, in this jail's layout: a factory of each VM's jail (its
        leased uid, its cgroup's limits) and what gives its uid back once it is gone."""
        chroot_base.mkdir(parents=True, exist_ok=True)

        def make(config: VMConfig) -> JailerConfig:
            uid = self.uids.lease(config.vm_id)
            limits = self.limits(config.vcpus, config.memory_mib)
            return JailerConfig(
                id=config.vm_id, firecracker_binary=binary, uid=uid, gid=uid,
                chroot_base_dir=chroot_base, cgroup_version=2 if self.cgroups.v2 else 1,
                cgroups=self.cgroups.files(limits), parent_cgroup=PARENT,
            )  # fmt: skip

        return make, lambda jail: self.uids.release(jail.uid, jail.id)

    def release(self, record: dict[str, Any]) -> None:
        """Give back the uid and cgroup of a VMM that is gone (`record` is `Confinement.record`)."""
        if not self.cgroups.remove(str(record["cgroup"])):
            log.warning("cgroup %s of a VMM still holds processes", record["cgroup"])
        self.uids.release(int(record["uid"]))

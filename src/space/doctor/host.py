"""The host the doctor looks at: where its devices, kernel interfaces and SPACE's directories are.

Everything a check reads goes through a `Host`, so a test can point the checks at a /dev
without /dev/kvm, a /proc whose meminfo says 200 MiB, or another pool directory, and see what
they say, without mocking. `SPACE_DOCTOR_DEV`, `SPACE_DOCTOR_SYS` and `SPACE_DOCTOR_PROC`
move the roots for a whole `space doctor` run. What the checks run for real (the KVM probe
boot, losetup, nft in a namespace) uses the machine's own devices: hiding one from them takes
a mount namespace (tests/cli/test_doctor.py does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from space.settings import Settings


@dataclass(frozen=True)
class HostPaths:
    dev: Path = Path("/dev")
    sys: Path = Path("/sys")
    proc: Path = Path("/proc")

    @classmethod
    def from_env(cls) -> HostPaths:
        env = os.environ
        return cls(
            dev=Path(env.get("SPACE_DOCTOR_DEV", "/dev")),
            sys=Path(env.get("SPACE_DOCTOR_SYS", "/sys")),
            proc=Path(env.get("SPACE_DOCTOR_PROC", "/proc")),
        )


@dataclass(frozen=True)
class Host:
    """The roots, and the settings of a deployment that change what a host needs."""

    paths: HostPaths = field(default_factory=HostPaths)
    state_dir: Path = Path("/var/lib/space")
    cache_dir: Path = Path("/var/cache/space")
    pool_dir: Path | None = None  # SPACE_POOL_DIR: an existing file system instead of an image
    accel: str = "auto"  # SPACE_ACCEL: auto, kvm or tcg
    network: bool = True  # SPACE_WORKER_NETWORK=0: VMs have no NIC, so no tap, netns, nftables
    reserve_mib: int = 1024  # SPACE_POOL_RESERVE_MIB: memory warm pools leave free
    driver: str = "qemu"  # SPACE_WORKER_DRIVER
    jail: bool = True  # SPACE_WORKER_JAIL

    @classmethod
    def from_settings(cls, settings: Settings) -> Host:
        """The host as the deployment's settings (read once, as every service reads them)
        describe it, at the roots `SPACE_DOCTOR_*` name."""
        w = settings.worker
        return cls(
            paths=HostPaths.from_env(),
            state_dir=settings.state_dir,
            cache_dir=settings.cache_dir,
            pool_dir=w.pool_dir,
            accel=w.accel,
            network=w.network,
            reserve_mib=settings.pools.reserve_mib,
            driver=w.driver,
            jail=w.jail.enabled,
        )

    @property
    def pool_root(self) -> Path:
        """Where the worker keeps its pool (space.worker.storage.pool.ensure_pool)."""
        return self.pool_dir or self.state_dir / "pool"

    def dev(self, name: str) -> Path:
        return self.paths.dev / name

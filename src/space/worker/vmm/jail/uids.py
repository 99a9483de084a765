"""A uid (and gid of the same number) for each jailed VMM, from a range the host's workers own.

Leases are files under /run (gone with a reboot, as the VMMs are), made with O_EXCL so that
several workers on one host never hand out one uid twice. A lease names its VM and, once
started, the VMM's pid; a lease whose VMM is gone (its pid dead, or running as another uid) and
that is older than `STALE_S` is taken back.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

LEASES = Path("/run/space/vmm-uids")
STALE_S = 60.0  # a lease without a live VMM this long after it was made is free again


class UidsExhausted(RuntimeError):
    pass


class UidRange:
    def __init__(self, base: int, count: int, leases: Path = LEASES) -> None:
        if base <= 0 or count <= 0 or base + count > 0xFFFFFFFE:
            raise ValueError(f"bad VMM uid range {base}+{count}")
        self.base = base
        self.count = count
        self.leases = leases

    def lease(self, vm_id: str) -> int:
        self.leases.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = secrets.randbelow(self.count)
        for i in range(self.count):
            uid = self.base + (start + i) % self.count
            path = self.leases / str(uid)
            for _ in range(2):
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    if not self._stale(path, uid):
                        break
                    path.unlink(missing_ok=True)
                    continue
                with os.fdopen(fd, "w") as f:
                    f.write(f"{vm_id}\n")
                return uid
        raise UidsExhausted(f"all {self.count} VMM uids from {self.base} are in use")

    def started(self, uid: int, vm_id: str, pid: int) -> None:
        """Record the VMM's pid in its lease (what tells a live lease from a stale one)."""
        tmp = self.leases / f".{uid}.tmp"
        tmp.write_text(f"{vm_id}\n{pid}\n")
        tmp.replace(self.leases / str(uid))

    def release(self, uid: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.leases / str(uid)).unlink()

    def _stale(self, path: Path, uid: int) -> bool:
        try:
            made = path.stat().st_mtime
            lines = path.read_text().split()
        except OSError:
            return False
        if len(lines) >= 2 and lines[1].isdigit() and _runs_as(int(lines[1]), uid):
            return False
        return time.time() - made > STALE_S


def _runs_as(pid: int, uid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1]) == uid
    return False

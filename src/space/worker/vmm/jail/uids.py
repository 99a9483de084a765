"""A uid (and gid of the same number) for each jailed VMM, from a range the host's workers own.

Leases are files under /run (gone with a reboot, as the VMMs are), made under a lock the host's
workers share, so that they never hand out one uid twice. A lease names its VM; one older than
`STALE_S` whose uid no process runs as is taken back (found by uid, not pid: a jailer drops to
the uid without telling us the pid it runs Firecracker as).
"""

from __future__ import annotations

import contextlib
import fcntl
import secrets
import time
from collections.abc import Iterator
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
        with self._locked():  # one judge of staleness at a time, across the host's workers
            for i in range(self.count):
                uid = self.base + (start + i) % self.count
                path = self.leases / str(uid)
                if path.exists():
                    if not self._stale(path, uid):
                        continue
                    path.unlink(missing_ok=True)
                with open(path, "x") as f:
                    f.write(f"{vm_id}\n")
                return uid
        raise UidsExhausted(f"all {self.count} VMM uids from {self.base} are in use")

    def release(self, uid: int, vm_id: str | None = None) -> None:
        """Give `uid` back; with `vm_id`, only if its lease is still that VM's (not taken back
        as stale and given to another meanwhile)."""
        path = self.leases / str(uid)
        with self._locked():
            if vm_id is not None:
                try:
                    if path.read_text().split()[:1] != [vm_id]:
                        return
                except OSError:
                    return
            path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.leases.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.leases / ".lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _stale(self, path: Path, uid: int) -> bool:
        """No process runs as `uid` (the VMM, or a jailer that dropped to it without telling
        its pid) and the lease is older than STALE_S (not a VMM being started)."""
        try:
            made = path.stat().st_mtime
        except OSError:
            return False
        if time.time() - made <= STALE_S:
            return False
        return not any(_runs_as(int(p.name), uid) for p in Path("/proc").iterdir()
                       if p.name.isdigit())  # fmt: skip


def _runs_as(pid: int, uid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1]) == uid
    return False

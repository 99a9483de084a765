"""VMM uid leases: unique across workers of a host, taken back only from VMMs that are gone."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from space.worker.vmm.jail.uids import STALE_S, UidRange, UidsExhausted


def test_leases_are_unique_and_run_out(tmp_path: Path) -> None:
    a, b = UidRange(2_000_000, 3, tmp_path), UidRange(2_000_000, 3, tmp_path)  # two workers
    uids = {a.lease("x"), b.lease("y"), a.lease("z")}
    assert uids == {2_000_000, 2_000_001, 2_000_002}
    with pytest.raises(UidsExhausted):
        b.lease("w")
    a.release(2_000_001)
    assert b.lease("w") == 2_000_001


def test_a_lease_is_taken_back_only_when_its_vmm_is_gone_and_it_is_old(tmp_path: Path) -> None:
    uids = UidRange(2_000_000, 1, tmp_path)
    uid = uids.lease("vm")
    lease = tmp_path / str(uid)
    old = time.time() - STALE_S - 1
    # Not started yet, but young: a VMM being launched.
    with pytest.raises(UidsExhausted):
        uids.lease("other")
    # A live process that runs as that uid holds it however old the lease.
    proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                             "sleep", "30"])  # fmt: skip
    try:
        for _ in range(100):
            if f"\t{uid}\t" in Path(f"/proc/{proc.pid}/status").read_text():
                break
            time.sleep(0.01)
        os.utime(lease, (old, old))
        with pytest.raises(UidsExhausted):
            uids.lease("other")
    finally:
        proc.kill()
        proc.wait()
    # Its VMM is gone and the lease is old: free again.
    os.utime(lease, (old, old))
    assert uids.lease("other") == uid
    assert lease.read_text() == "other\n"

"""Exhaustion attacks from inside a sandbox harm only that sandbox: a memory hog meets its own
VM's limit, a fork bomb fills only its own guest, and the neighbours keep answering."""

from __future__ import annotations

from pathlib import Path

from ..vm.conftest import vmm_pids
from .conftest import Platform
from .helpers import create, exec_events, run

POOL = Path("/var/lib/space/pool/workers")


def test_memory_and_fork_exhaustion_stay_in_their_sandbox(platform: Platform) -> None:
    with platform.client() as c:
        neighbour = create(c)
        hog = create(c, memory_mib=256)
        # Memory: the guest's own limit stops it (MemoryError or its OOM killer), nothing else.
        grab = "l = []\nwhile True: l.append(bytearray(32 << 20))"
        _, _, code = run(c, hog["id"], f"python3 -c '{grab}'")
        assert code != 0
        out, _, _ = run(c, hog["id"], "echo still-here")
        assert out == b"still-here\n"  # its agent (PID 1, never the OOM killer's) survived

        # A fork bomb, cut short: the guest fills up; the neighbour answers throughout.
        events = exec_events(c, hog["id"], cmd="b(){ b | b & }; b", timeout=5)
        assert events[-1]["type"] in ("exit", "error")
        for _ in range(3):
            out, _, code = run(c, neighbour["id"], "echo fine")
            assert (out, code) == (b"fine\n", 0)

        # Deleting the exhausted sandbox still works and leaves no process behind.
        r = c.delete(f"/v1/sandboxes/{hog['id']}")
        assert r.status_code == 200 and r.json()["state"] == "deleted", r.text
        assert not [p for w in platform.workers for p in vmm_pids(POOL / w / "vms" / hog["id"])]
        c.delete(f"/v1/sandboxes/{neighbour['id']}")

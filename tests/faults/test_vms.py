"""Faults of one VM: its VMM frozen, or killed. Recovery never deletes a sandbox's data."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest

from ..leaks import POOL
from ..platform.helpers import counter_runs, create, run, start_counter
from ..stack import Platform
from ..vm.conftest import vmm_pids
from .conftest import record, until

pytestmark = pytest.mark.vm

# Noticed within a probe, then a whole boot from disk: under TCG that alone takes 5-10 s.
REBOOT_S = 20.0


def vmm_of(platform: Platform, sid: str) -> int:
    found = vmm_pids(POOL / "workers" / platform.worker_id / "vms" / sid)
    assert len(found) == 1, f"VMMs of {sid}: {found}\n{platform.logs()}"
    return found.pop()


def state(c: httpx.Client, sid: str) -> dict[str, object]:
    return dict(c.get(f"/v1/sandboxes/{sid}").json())


def test_a_frozen_vmm_is_reported_and_comes_back_untouched(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
        vmm = vmm_of(platform, sid)
        os.kill(vmm, signal.SIGSTOP)
        try:
            seen = until(lambda: state(c, sid)["state"] == "error", 30)
            record("VMM frozen (SIGSTOP)", "its sandbox shows it", 10.0, seen)
            assert "does not answer" in str(state(c, sid)["reason"])
            started = time.monotonic()
            r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"})
            assert r.status_code == 409, r.text
            record("exec on a frozen VM", "refused at once, not held", 2.0,
                   time.monotonic() - started)  # fmt: skip
        finally:
            os.kill(vmm, signal.SIGCONT)
        back = until(lambda: state(c, sid)["state"] == "running", 30)
        record("VMM continued (SIGCONT)", "its sandbox back to running", 10.0, back)
        assert vmm_of(platform, sid) == vmm, "never killed for being slow"
        assert counter_runs(c, sid, pid)
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_killed_vmm_is_booted_again_from_its_own_disk(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        run(c, sid, "echo kept > /root/kept && sync")
        pid = start_counter(c, sid)
        vmm = vmm_of(platform, sid)
        boot = state(c, sid)["boot"]
        os.kill(vmm, signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: _rebooted(c, sid), 60)
        record("VMM killed (kill -9)", "booted again from its disk, running", REBOOT_S,
               time.monotonic() - killed)  # fmt: skip
        assert vmm_of(platform, sid) != vmm
        assert run(c, sid, "cat /root/kept")[0] == b"kept\n", "its files are kept"
        assert run(c, sid, f"kill -0 {pid}")[2] != 0, "its processes are not"
        events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
        said = [e["reason"] for e in events if e["to_state"] == "starting" and e["reason"]]
        assert said and "files are kept" in said[-1] and "killed by signal 9" in said[-1], events
        assert state(c, sid)["boot"] == boot, "how it first came to run is kept"
        c.delete(f"/v1/sandboxes/{sid}")


def _rebooted(c: httpx.Client, sid: str) -> bool:
    """Running again after a reboot: from its events alone (its state, read apart, may be of a
    moment before the reboot was even decided)."""
    events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
    again = [i for i, e in enumerate(events)
             if e["to_state"] == "starting" and "again" in (e["reason"] or "")]  # fmt: skip
    return bool(again) and any(
        e["type"] == "state" and e["to_state"] == "running" for e in events[again[-1] + 1 :]
    )


def test_a_delete_wins_over_a_suspend_of_a_frozen_vmm(platform: Platform) -> None:
    """A suspend in flight on a VMM that stopped answering (SIGSTOP) never holds its sandbox's
    delete: the worker kills that VMM, which fails the suspend, and removes everything."""
    with platform.client() as c:
        sid = create(c)["id"]
        run(c, sid, "echo x > /root/x")
        vmm = vmm_of(platform, sid)
        run_dir = POOL / "workers" / platform.worker_id / "vms" / sid
        os.kill(vmm, signal.SIGSTOP)
        suspend = threading.Thread(target=_suspend, args=(platform, sid), daemon=True)
        try:
            suspend.start()
            until(lambda: state(c, sid)["state"] == "suspending", 10)
            time.sleep(1)  # the worker is in the suspend, waiting on the frozen VMM
            started = time.monotonic()
            r = c.delete(f"/v1/sandboxes/{sid}", timeout=60)
            assert r.status_code == 200 and r.json()["state"] == "deleted", r.text
            record("delete while a suspend waits on a frozen VMM (SIGSTOP)",
                   "deleted: its VMM killed, its files gone", 15.0,
                   time.monotonic() - started)  # fmt: skip
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vmm, signal.SIGCONT)
        suspend.join(60)
        assert not vmm_pids(run_dir) and not run_dir.exists()
        assert not (POOL / "workers" / platform.worker_id / "suspended" / sid).exists()


def _suspend(platform: Platform, sid: str) -> None:
    with platform.client() as c, contextlib.suppress(httpx.HTTPError):
        c.post(f"/v1/sandboxes/{sid}/suspend", timeout=120)


def test_a_suspend_of_a_frozen_vmm_fails_in_time_and_leaves_it_whole(platform: Platform) -> None:
    """A suspend of a VMM that stopped answering fails within its bound, with the reason; the
    sandbox is never half-suspended, and once the VMM runs again so does the sandbox, with its
    files and processes."""
    with platform.client() as c:
        sid = create(c)["id"]
        run(c, sid, "echo kept > /root/kept")
        pid = start_counter(c, sid)
        vmm = vmm_of(platform, sid)
        os.kill(vmm, signal.SIGSTOP)
        try:
            started = time.monotonic()
            c.post(f"/v1/sandboxes/{sid}/suspend", timeout=120)
            until(lambda: state(c, sid)["state"] not in ("running", "suspending"), 60)
            record("suspend of a frozen VMM (SIGSTOP)", "fails with the reason, not half-done",
                   20.0, time.monotonic() - started)  # fmt: skip
            sb = state(c, sid)
            assert sb["state"] in ("running", "error"), sb
            assert sb["reason"], sb
            assert not (POOL / "workers" / platform.worker_id / "suspended" / sid).exists()
            for verb, path in (("checkpoint", "checkpoints"), ("pause", "pause")):
                started = time.monotonic()
                r = c.post(f"/v1/sandboxes/{sid}/{path}", json={}, timeout=120)
                until(lambda: state(c, sid)["state"] not in ("pausing",), 60)
                record(f"{verb} of a frozen VMM (SIGSTOP)", "refused or failed, with the reason",
                       15.0, time.monotonic() - started)  # fmt: skip
                assert r.status_code >= 400 or state(c, sid)["reason"], r.text
                assert state(c, sid)["state"] in ("running", "error")
        finally:
            os.kill(vmm, signal.SIGCONT)
        until(lambda: state(c, sid)["state"] == "running", 30)
        assert vmm_of(platform, sid) == vmm
        assert run(c, sid, "cat /root/kept")[0] == b"kept\n"
        assert counter_runs(c, sid, pid)
        c.delete(f"/v1/sandboxes/{sid}")

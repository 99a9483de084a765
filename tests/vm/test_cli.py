"""The debug CLI drives VMs across separate invocations: boot, exec, snapshot, restore, rm."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from space.worker.local import LocalRuntime

from .conftest import vmm_pids

pytestmark = pytest.mark.vm

SPACE = str(Path(sys.executable).parent / "space")


def space(*args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [SPACE, *args],
        input=b"" if input is None else input,
        capture_output=True,
        timeout=300,
        check=False,
    )


def test_cli_boot_exec_snapshot_restore_rm(runtime: LocalRuntime, tmp_path: Path) -> None:
    vm_id, clone_id = f"cli{uuid.uuid4().hex[:6]}", f"clone{uuid.uuid4().hex[:6]}"
    before = vmm_pids(runtime.pool.vms)
    try:
        boot = space("vm", "boot", "--id", vm_id)
        assert boot.returncode == 0, boot.stderr.decode()
        assert vm_id in boot.stdout.decode()
        assert (
            len(vmm_pids(runtime.pool.vms) - before) == 1
        )  # the VM outlives the command that booted it

        r = space("vm", "exec", vm_id, "--", "sh", "-c", "uname -r; echo oops >&2; exit 3")
        assert r.returncode == 3
        assert r.stdout.decode().strip().endswith("-cloud-amd64")
        assert r.stderr == b"oops\n"

        r = space("vm", "exec", vm_id, "--", "sha256sum", input=b"piped through")
        assert r.returncode == 0 and r.stdout.startswith(b"2")

        assert vm_id in space("vm", "ls").stdout.decode()

        snap = tmp_path / "snap"
        r = space("vm", "snapshot", vm_id, str(snap))
        assert r.returncode == 0, r.stderr.decode()
        r = space("vm", "restore", str(snap), "--id", clone_id)
        assert r.returncode == 0, r.stderr.decode()
        r = space("vm", "exec", clone_id, "--", "hostname")
        assert r.stdout.decode().strip() == f"sb-{clone_id}"

        bad = space("vm", "exec", "no-such-vm", "--", "true")
        assert bad.returncode != 0 and b"Traceback" not in bad.stderr
        assert b"no-such-vm" in bad.stderr
    finally:
        space("vm", "rm", vm_id)
        space("vm", "rm", clone_id)
    assert vmm_pids(runtime.pool.vms) == before
    assert not (runtime.pool.vms / vm_id).exists()

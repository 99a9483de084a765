"""Escape drills: a process with one VMM's exact confinement (its uid, namespaces, cgroups,
descriptors and seccomp filter, `drill.py --as-vmm`) stands in for a VMM a guest has taken over
and tries, one case each, to reach what it must not. Every attack is also run unconfined, as
root on the host, and must work there: no case passes because the attack itself is broken.

The two VMs are clones of one mapped snapshot, as a worker's base snapshot makes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from space.settings import JailSettings
from space.worker.local import LocalRuntime
from space.worker.machine import Machine
from space.worker.vmm.base import SnapshotInfo
from space.worker.vmm.jail import Jail

pytestmark = pytest.mark.vm

DRILL = Path(__file__).with_name("drill.py")


@dataclass
class World:
    attacker: Machine  # its VMM's confinement is the drill's
    victim: Machine  # another tenant's VM
    snapshot: SnapshotInfo  # the mapped snapshot both were restored from
    key: Path  # a root-only file on the host: the secrets key, a CA key, a worker key
    db_socket: Path  # a unix socket on the host: the database's
    tcp_port: int  # a listener on the host's loopback
    bystander: int  # a root process on the host


@pytest.fixture(scope="module")
async def world(
    runtime: LocalRuntime, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("drill")
    source = await Machine.boot(runtime.driver, runtime.pool, runtime.images, snapshot_source=True)
    snap_dir = runtime.pool.vms / f".drill-{source.id}"
    try:
        snapshot = await source.snapshot(snap_dir)
    finally:
        await source.close()
    assert "memory" in snapshot.files
    attacker = await Machine.restore(runtime.driver, runtime.pool, snapshot)
    victim = await Machine.restore(runtime.driver, runtime.pool, snapshot)
    key = tmp / "secrets.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    db = socket.socket(socket.AF_UNIX)
    db.bind(str(tmp / ".s.PGSQL.5432"))
    db.listen(64)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(64)
    bystander = subprocess.Popen(["sleep", "600"])  # noqa: ASYNC220 - it runs on its own
    try:
        yield World(attacker, victim, snapshot, key, tmp / ".s.PGSQL.5432",
                    tcp.getsockname()[1], bystander.pid)  # fmt: skip
    finally:
        bystander.kill()
        bystander.wait()
        db.close()
        tcp.close()
        await attacker.close()
        await victim.close()
        shutil.rmtree(snap_dir, ignore_errors=True)


def drill(attack: str, params: dict[str, Any], vmm_pid: int | None) -> tuple[int, dict[str, Any]]:
    argv = [sys.executable, str(DRILL), attack, json.dumps(params)]
    if vmm_pid is not None:
        argv += ["--as-vmm", str(vmm_pid)]
    r = subprocess.run(argv, capture_output=True, timeout=120)
    lines = r.stdout.decode().strip().splitlines()
    return r.returncode, json.loads(lines[-1]) if lines else {"stderr": r.stderr.decode()[-2000:]}


def _victim(w: World, name: str) -> dict[str, Any]:
    return {"path": str(w.victim.run_dir / name)}


def _snapshot_memory(w: World) -> dict[str, Any]:
    return {"path": str(w.snapshot.path / w.snapshot.files["memory"])}


Params = Callable[[World], dict[str, Any]]
CASES: dict[str, tuple[str, Params]] = {
    "another sandbox's disk, read": ("read_file", lambda w: {"path": str(w.victim.disk)}),
    "another sandbox's disk, written": ("write_file", lambda w: {"path": str(w.victim.disk)}),
    "another sandbox's memory file": (
        "read_file", lambda w: {"path": str(w.victim.vm.config.memory_file)}),
    "another sandbox's agent socket": ("connect_unix", lambda w: _victim(w, "agent.sock")),
    "another sandbox's VMM monitor": ("connect_unix", lambda w: _victim(w, "qmp.sock")),
    "another sandbox's /proc": ("read_proc", lambda w: {"pid": w.victim.vm.status().pid}),
    "the base snapshot's memory file, written": ("write_file", _snapshot_memory),
    "a key on the host": ("read_file", lambda w: {"path": str(w.key)}),
    "the host's password hashes": ("read_file", lambda w: {"path": "/etc/shadow"}),
    "the database's socket": ("connect_unix", lambda w: {"path": str(w.db_socket)}),
    "a socket outside its namespace": (
        "connect_tcp", lambda w: {"host": "127.0.0.1", "port": w.tcp_port}),
    "ptrace a host process": ("ptrace", lambda w: {"pid": w.bystander}),
    "exec a binary": ("exec_binary", lambda w: {}),
    "mount a file system": ("mount", lambda w: {}),
    "load a kernel module": ("load_module", lambda w: {}),
    "become root": ("raise_privileges", lambda w: {}),
    "threads past its pids limit": ("threads", lambda w: {"count": JailSettings().pids + 20}),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_taken_over_vmm_reaches_nothing(world: World, case: str) -> None:
    attack, make_params = CASES[case]
    params = make_params(world)
    if attack == "load_module" and not Path("/proc/modules").exists():
        pytest.skip("this host's kernel loads no modules at all: the control cannot show one")
    if case == "another sandbox's memory file" and world.victim.vm.config.memory_file == Path(
        _snapshot_memory(world)["path"]
    ):
        pytest.skip("both map the snapshot's own file, read-only: their own pages are anonymous")
    code, control = drill(attack, params, None)
    assert code == 0 and control == {"outcome": "done"}, f"the attack fails unjailed: {control}"
    vmm = world.attacker.vm.status().pid
    assert vmm is not None
    code, result = drill(attack, params, vmm)
    killed = code == -signal.SIGSYS  # the VMM's seccomp filter
    assert killed or (code == 0 and result.get("outcome") == "refused"), (code, result)
    # Nothing of the attack reached the VMs: both still answer.
    assert world.attacker.vm.status().pid == vmm


async def test_memory_past_the_limit_is_the_vmms_own_loss(
    runtime: LocalRuntime, world: World
) -> None:
    """Allocating past the cgroup's memory limit ends the allocating process (the OOM killer in
    that cgroup), never the host's memory."""
    settings = JailSettings()
    limit = Jail(settings).limits(1, world.attacker.vm.config.memory_mib).memory_bytes
    params = {"bytes": limit + (64 << 20)}
    code, control = drill("allocate", params, None)
    assert code == 0 and control == {"outcome": "done"}
    code, result = drill("allocate", params, world.attacker.vm.status().pid)
    assert code == -signal.SIGKILL, (code, result)
    assert (await world.victim.agent.run(["true"])).exit_code == 0

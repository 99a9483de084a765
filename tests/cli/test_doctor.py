"""`space doctor` on this host (whose /dev/kvm exists but cannot run guests), and on hosts made
by hiding things from it for real: devices bind-mounted over or left out of a private /dev in
a mount namespace, tools left off PATH, a small tmpfs as a cache, other /proc and /sys roots.
Nothing is mocked; the other engineers' processes keep the real devices."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from space import paths
from space.doctor import CHECKS
from space.worker.images.kernel import kernel_root
from tests.cli.runner import modules, space

KEYS = {"id", "status", "summary", "detail", "fix"}


def doctor(*only: str, env: dict[str, str] | None = None, setup: str = "") -> tuple[int, Any]:
    """`space doctor --json --only ...`: its exit status and document. With `setup` (shell
    commands), it runs in a private mount namespace once they have run there."""
    argv = [sys.executable, "-m", "space.cli.main", "doctor", "--json"]
    argv += [f"--only={check}" for check in only]
    if setup:
        script = f'set -e\n{setup}\nexec "$@"'
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={**os.environ, **(env or {})})  # fmt: skip
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, json.loads(run.stdout)


def one(document: Any, check_id: str) -> dict[str, str]:
    found = [c for c in document["checks"] if c["id"] == check_id]
    assert len(found) == 1, document
    return found[0]


def hidden(*devices: str) -> str:
    """Shell commands that bind-mount an empty file over each device."""
    return "empty=$(mktemp)\n" + "".join(f"mount --bind $empty {d}\n" for d in devices)


# A /dev of its own with only what any process needs: no kvm, tun or loop devices.
PRIVATE_DEV = """
mount -t tmpfs -o mode=755 none /dev
mknod -m 666 /dev/null c 1 3
mknod -m 666 /dev/zero c 1 5
mknod -m 666 /dev/urandom c 1 9
"""


def test_this_host_every_check_and_what_the_worker_decided() -> None:
    status, document = doctor()
    assert [c["id"] for c in document["checks"]] == list(CHECKS)
    assert all(set(c) == KEYS for c in document["checks"])
    assert all(c["status"] in ("ok", "warn", "fail") for c in document["checks"])
    counts = {s: sum(c["status"] == s for c in document["checks"]) for s in ("ok", "warn", "fail")}
    assert document["counts"] == counts
    assert status == (1 if counts["fail"] else 0)
    for c in document["checks"]:
        if c["status"] != "ok":
            assert c["detail"] and c["fix"], c  # every problem says what it means and the fix
    # The doctor's KVM answer is the worker's own: the probe boot it ran or found, written
    # where the worker reads it (space.worker.vmm.accel.choose_accel).
    kvm = one(document, "kvm")
    probed = json.loads((paths.cache_dir() / "accel.json").read_text())
    assert probed["key"].startswith(f"{os.uname().release}/")
    assert (kernel_root() / probed["key"].split("/", 1)[1] / "manifest.json").exists()
    if probed["accel"] == "kvm":
        assert kvm["status"] == "ok"
    else:  # this machine: /dev/kvm is there, a guest cannot boot under it
        assert Path("/dev/kvm").exists()
        assert kvm["status"] == "warn"
        assert kvm["summary"] == (
            f"/dev/kvm is present but broken ({probed['why']}): VMs will run under TCG"
        )
        assert "TCG" in kvm["detail"]
        assert str(paths.cache_dir() / "accel.json") in kvm["detail"]


def test_the_real_things_work_here() -> None:
    _, document = doctor("root", "tun", "loop", "pool", "netns", "nftables", "qemu")
    assert {c["id"]: c["status"] for c in document["checks"]} == {
        "root": "ok", "tun": "ok", "loop": "ok", "pool": "ok", "netns": "ok", "nftables": "ok",
        "qemu": "ok",
    }  # fmt: skip
    assert "FICLONE works" in one(document, "pool")["summary"]


@pytest.mark.parametrize(
    ("device", "check", "fix"),
    [
        ("/dev/net/tun", "tun", "modprobe tun"),
        ("/dev/loop-control", "loop", "modprobe loop"),
    ],
)
def test_a_device_bound_over_by_a_file_fails_with_its_fix(
    device: str, check: str, fix: str
) -> None:
    status, document = doctor(check, setup=hidden(device))
    assert status == 1
    found = one(document, check)
    assert found["status"] == "fail"
    assert found["summary"] == f"{device} is not a device node"
    assert fix in found["fix"]


def test_a_hidden_kvm_is_tcg_unless_kvm_is_insisted_on() -> None:
    status, document = doctor("kvm", setup=hidden("/dev/kvm"))
    kvm = one(document, "kvm")
    assert (status, kvm["status"]) == (0, "warn")
    assert kvm["summary"] == "/dev/kvm is not a device node"
    assert "TCG" in kvm["detail"] and "modprobe kvm_intel" in kvm["fix"]
    status, document = doctor("kvm", setup=hidden("/dev/kvm"), env={"SPACE_ACCEL": "kvm"})
    kvm = one(document, "kvm")
    assert (status, kvm["status"]) == (1, "fail")
    assert "no VM can start" in kvm["detail"]
    _, document = doctor("kvm", env={"SPACE_ACCEL": "tcg"})
    assert one(document, "kvm")["summary"] == "TCG forced by SPACE_ACCEL=tcg"


def test_a_private_dev_without_the_devices() -> None:
    status, document = doctor("kvm", "tun", "loop", setup=PRIVATE_DEV)
    assert status == 1
    assert {c["id"]: (c["status"], c["summary"]) for c in document["checks"]} == {
        "kvm": ("warn", "no /dev/kvm: this kernel has no KVM, or it is not loaded"),
        "tun": ("fail", "no /dev/net/tun"),
        "loop": ("fail", "no /dev/loop-control"),
    }
    assert "mknod /dev/net/tun c 10 200" in one(document, "tun")["fix"]


@pytest.mark.parametrize("off", ["0", "false", "no", "off"])
def test_a_worker_without_network_needs_no_tun_however_it_is_said(off: str) -> None:
    """The doctor reads SPACE_WORKER_NETWORK as the worker does (Settings), so "false" is off
    for both."""
    status, document = doctor("tun", "netns", env={"SPACE_WORKER_NETWORK": off},
                              setup=PRIVATE_DEV)  # fmt: skip
    assert status == 0, document
    assert {c["id"]: c["status"] for c in document["checks"]} == {"tun": "ok", "netns": "ok"}
    assert "not needed" in one(document, "tun")["summary"]


def test_a_setting_the_worker_would_refuse_is_refused_by_the_doctor() -> None:
    run = space("doctor", "--only=tun", env={"SPACE_WORKER_NETWORK": "maybe"}, status=1)
    assert "SPACE_WORKER_NETWORK must be 0 or 1, not 'maybe'" in run.stderr
    assert "Traceback" not in run.stderr


def test_loop_devices_are_only_a_warning_with_a_pool_of_ones_own(tmp_path: Path) -> None:
    env = {"SPACE_POOL_DIR": str(tmp_path)}
    _, document = doctor("loop", setup=hidden("/dev/loop-control"), env=env)
    assert one(document, "loop")["status"] == "warn"


def test_other_dev_sys_and_proc_roots(tmp_path: Path) -> None:
    dev, sys_root, proc = tmp_path / "dev", tmp_path / "sys", tmp_path / "proc"
    (sys_root / "fs" / "cgroup").mkdir(parents=True)
    (sys_root / "fs" / "cgroup" / "cgroup.controllers").write_text("cpuset cpu io\n")
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal: 1048576 kB\nMemAvailable: 409600 kB\n")
    dev.mkdir()
    env = {"SPACE_DOCTOR_DEV": str(dev), "SPACE_DOCTOR_SYS": str(sys_root),
           "SPACE_DOCTOR_PROC": str(proc)}  # fmt: skip
    status, document = doctor("kvm", "tun", "loop", "cgroups", "memory", env=env)
    assert status == 1
    found = {c["id"]: c for c in document["checks"]}
    assert found["kvm"]["summary"].startswith(f"no {dev}/kvm")
    assert found["tun"]["summary"] == f"no {dev}/net/tun"
    assert found["loop"]["summary"] == f"no {dev}/loop-control"
    assert found["cgroups"]["status"] == "warn"
    assert found["cgroups"]["summary"].endswith("lacks memory, pids")
    assert found["memory"]["status"] == "fail"
    assert found["memory"]["summary"].startswith("400 MiB available: not enough")
    (proc / "meminfo").write_text("MemAvailable: 2097152 kB\n")
    (sys_root / "fs" / "cgroup" / "cgroup.controllers").write_text("cpu memory pids io\n")
    _, document = doctor("memory", "cgroups", env=env)
    assert one(document, "memory")["status"] == "warn"  # the services and a sandbox fit
    assert one(document, "cgroups")["status"] == "ok"


def test_a_pool_that_cannot_reflink_warns(tmp_path: Path) -> None:
    # /dev/shm is tmpfs, which cannot clone files; the default pool (btrfs) can.
    with_copies = Path("/dev/shm") / tmp_path.name
    with_copies.mkdir()
    try:
        _, document = doctor("pool", env={"SPACE_POOL_DIR": str(with_copies)})
    finally:
        shutil.rmtree(with_copies)
    pool = one(document, "pool")
    assert pool["status"] == "warn"
    assert pool["summary"] == f"{with_copies} (tmpfs) cannot clone files (FICLONE)"
    assert "full copy" in pool["detail"] and "btrfs or XFS" in pool["fix"]


def test_a_kernel_without_btrfs_cannot_make_the_pool(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "filesystems").write_text("nodev\ttmpfs\n\text4\n")
    env = {"SPACE_STATE_DIR": str(tmp_path / "state"), "SPACE_DOCTOR_PROC": str(proc)}
    status, document = doctor("pool", env=env)
    if any(Path(f"/lib/modules/{os.uname().release}").glob("kernel/fs/btrfs/btrfs.ko*")):
        assert one(document, "pool")["status"] == "ok"  # mounting would load the module
    else:
        assert status == 1
        assert one(document, "pool")["summary"] == "this kernel has no btrfs (`modprobe btrfs`)"
    (proc / "filesystems").write_text("\tbtrfs\n")
    _, document = doctor("pool", env=env)
    assert one(document, "pool")["summary"].startswith(
        f"the btrfs pool image {tmp_path / 'state' / 'pool.img'} will be made"
    )


def test_missing_tools_are_named_with_their_packages(tmp_path: Path) -> None:
    bare = {"PATH": str(tmp_path)}  # nothing on PATH: python is run by its full path
    status, document = doctor("qemu", "nftables", "tools", env=bare)
    assert status == 1
    found = {c["id"]: c for c in document["checks"]}
    assert found["qemu"]["fix"] == "`apt-get install qemu-system-x86`"
    assert found["nftables"]["summary"] == "nft is not installed"
    assert "mmdebstrap (package mmdebstrap)" in found["tools"]["summary"]
    assert "e2fsprogs" in found["tools"]["fix"]
    # Here the kernel and `base` are built already: only rebuilding them needs the tools.
    assert found["tools"]["status"] == "warn"
    _, document = doctor("tools", env={**bare, "SPACE_CACHE_DIR": str(tmp_path / "cache")})
    assert one(document, "tools")["status"] == "fail"


def test_a_small_cache_file_system_fails_then_warns(tmp_path: Path) -> None:
    mount = tmp_path / "cache"
    mount.mkdir()
    env = {"SPACE_CACHE_DIR": str(mount / "space")}
    status, document = doctor(
        "disk.cache", env=env, setup=f"mount -t tmpfs -o size=512m none {mount}"
    )
    assert (status, one(document, "disk.cache")["status"]) == (1, "fail")
    summary = one(document, "disk.cache")["summary"]
    assert summary.startswith("0.5 GiB free for the image cache")
    assert summary.endswith(f": {mount} (tmpfs)")
    _, document = doctor("disk.cache", env=env, setup=f"mount -t tmpfs -o size=2g none {mount}")
    assert one(document, "disk.cache")["status"] == "warn"


def test_not_root_fails() -> None:
    # A user namespace makes this process uid 1000 to itself.
    run = subprocess.run(
        ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-m",
         "space.cli.main", "doctor", "--json", "--only=root"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 1
    root = one(json.loads(run.stdout), "root")
    assert (root["status"], root["summary"]) == ("fail", "running as uid 1000, not root")
    assert "sudo" in root["fix"]


def test_human_output_and_bad_arguments() -> None:
    run = space("doctor", "--only=tun", "--only=qemu")
    lines = run.stdout.splitlines()
    assert lines[0].split()[:3] == ["✔", "ok", "tun"]
    assert lines[-1] == "2 ok, 0 warnings, 0 failures. SPACE can run here."
    assert "\x1b[" not in run.stdout  # no colours when piped
    problems = space("doctor", "--problems", "--only=tun", "--only=cgroups").stdout
    assert " tun " not in problems and "cgroups" in problems
    refused = space("doctor", "--only=nope", status=2)
    assert "no check nope" in refused.stderr


def test_the_doctor_never_loads_the_database_or_the_api() -> None:
    imported = modules(space("doctor", "--json", importtime=True))
    server = ("alembic", "sqlalchemy", "asyncpg", "fastapi", "starlette", "uvicorn", "space.db",
              "space.api", "space.controller")  # fmt: skip
    assert sorted(m for m in imported if m.split(".")[0] in server or m.startswith(server)) == []


def test_space_up_stops_before_anything_when_the_host_cannot_run_it() -> None:
    argv = [sys.executable, "-m", "space.cli.main", "up", "--port", "18979", "--worker-port",
            "18980", "--metrics-port", "18981"]  # fmt: skip
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"{hidden('/dev/net/tun')}exec \"$@\"", "sh", *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert "/dev/net/tun is not a device node" in run.stderr
    assert "Error: this host cannot run SPACE yet" in run.stderr
    assert "space up: database" not in run.stderr  # nothing else began
    assert "guest kernel" not in run.stderr and "guest kernel" not in run.stdout


def test_firecracker_is_checked_only_where_it_is_the_driver(tmp_path: Path) -> None:
    _, document = doctor("firecracker")
    assert one(document, "firecracker")["status"] == "ok"
    assert "not used" in one(document, "firecracker")["summary"]
    # A PATH without Firecracker or its jailer (this host has neither): the fix is named.
    env = {"SPACE_WORKER_DRIVER": "firecracker", "PATH": str(tmp_path)}
    status, document = doctor("firecracker", env=env)
    found = one(document, "firecracker")
    assert status == 1 and found["status"] == "fail", found
    assert found["summary"] == "firecracker and jailer not found" and "jailer" in found["fix"]
    # Both present (stand-ins that say their version), but the jail off: a VM has no network.
    for name, say in (("firecracker", "Firecracker v1.16.1"), ("jailer", "Jailer v1.16.1")):
        tool = tmp_path / name
        tool.write_text(f"#!/bin/sh\necho '{say}'\n")
        tool.chmod(0o755)
    _, document = doctor("firecracker", env={**env, "SPACE_WORKER_JAIL": "0"})
    found = one(document, "firecracker")
    assert found["status"] == "warn" and "without its jailer" in found["summary"], found
    _, document = doctor("firecracker", env=env)
    assert one(document, "firecracker") == {
        **one(document, "firecracker"),
        "status": "ok",
        "summary": "Firecracker v1.16.1 and its jailer",
    }

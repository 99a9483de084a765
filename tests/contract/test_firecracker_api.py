"""Contract tests of the Firecracker driver against Firecracker's published API (v1.16.1).

Firecracker cannot run here, so the real `FirecrackerDriver` drives a stand-in process
(`fake_firecracker.py`, NOT Firecracker) that checks every request against the real OpenAPI
spec and records it. These tests prove that what the driver sends is what the spec allows, in
the order Firecracker's documented rules need; they prove nothing about a real guest.
Also here: the jailer's command line and chroot layout (real hard links, as root) and the
hybrid-vsock handshake against real unix-socket peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import stat
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from space.settings import Shares
from space.worker.network import netns
from space.worker.network.manager import open_tap_device
from space.worker.vmm.base import (
    Drive,
    SnapshotInfo,
    VMConfig,
    VMGone,
    VMMError,
    VMState,
)
from space.worker.vmm.firecracker import AGENT_VSOCK_PORT, FirecrackerDriver, FirecrackerVM
from space.worker.vmm.firecracker.client import FirecrackerAPIError, FirecrackerClient
from space.worker.vmm.firecracker.jailer import (
    InvalidInstanceIdError,
    JailerConfig,
    JailerError,
    chroot_root,
    clone_file,
    jail_dir,
    jailer_argv,
    place_file,
    prepare_jail,
    validate_instance_id,
)
from space.worker.vmm.firecracker.vsock import VsockConnectError, connect_hybrid_vsock
from space.worker.vmm.jail.uids import UidRange

from .fake_firecracker import (
    IGNORE_CTRL_ALT_DEL_ENV,
    LOG_ENV,
    SPEC_ENV,
    Spec,
    SpecMissingError,
    load_records,
    write_launcher,
)

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown and mknod need root")
JAIL_UID, JAIL_GID = 1234, 5678
MAC = "06:00:ac:10:00:02"


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spec() -> Spec:
    # A missing spec is a failure, never a skip: without it nothing here proves anything.
    try:
        return Spec()
    except SpecMissingError as exc:
        pytest.fail(str(exc), pytrace=False)


@dataclass
class Fake:
    """The stand-in's launchers and the requests it recorded."""

    firecracker: Path
    deaf_firecracker: Path  # ignores SendCtrlAltDel, to test the kill fallback
    jailer: Path
    log: Path

    def records(self) -> list[dict[str, Any]]:
        return load_records(self.log)

    def requests(self, pid: int) -> list[dict[str, Any]]:
        return [r for r in self.records() if "method" in r and r["pid"] == pid]

    def calls(self, pid: int) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests(pid)]

    def body(self, pid: int, method: str, path: str) -> Any:
        bodies = [
            r["body"] for r in self.requests(pid) if (r["method"], r["path"]) == (method, path)
        ]
        assert len(bodies) == 1, f"expected one {method} {path}, got {len(bodies)}"
        return bodies[0]

    def start(self, pid: int) -> dict[str, Any]:
        return next(r for r in self.records() if r.get("event") == "start" and r["pid"] == pid)

    def problems(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("problem")]


@pytest.fixture
def fake(tmp_path: Path, spec: Spec) -> Fake:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "requests.jsonl"
    env = {LOG_ENV: str(log), SPEC_ENV: str(spec.path)}
    return Fake(
        firecracker=write_launcher(bin_dir / "fake-firecracker", env),
        deaf_firecracker=write_launcher(
            bin_dir / "deaf-fake-firecracker", env | {IGNORE_CTRL_ALT_DEL_ENV: "1"}
        ),
        jailer=write_launcher(bin_dir / "fake-jailer", env, jailer=True),
        log=log,
    )


@pytest.fixture(autouse=True)
def no_vmm_left_behind(tmp_path: Path) -> Iterator[None]:
    """A failing test must not leave a VMM running: kill what it started, then fail it."""
    yield
    leftovers = processes_mentioning(str(tmp_path))
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert leftovers == [], f"processes left behind (killed now): {leftovers}"


@dataclass
class Images:
    kernel: Path
    initrd: Path
    rootfs: Path


@pytest.fixture
def images(tmp_path: Path) -> Images:
    directory = tmp_path / "images"
    directory.mkdir()
    kernel = directory / "vmlinux"
    kernel.write_bytes(b"\x7fELF not really a kernel")
    initrd = directory / "initramfs.cpio"
    initrd.write_bytes(b"070701 not really an initramfs")
    rootfs = directory / "disk.ext4"
    with open(rootfs, "wb") as disk:  # sparse, with data at both ends
        disk.write(b"rootfs of vm-a")
        disk.seek(12 << 20)
        disk.write(b"a block further on")
        disk.truncate(16 << 20)
    for path in (kernel, initrd, rootfs):
        path.chmod(0o644)
    return Images(kernel, initrd, rootfs)


def make_config(images: Images, vm_id: str = "vm-a", **changes: Any) -> VMConfig:
    fields: dict[str, Any] = {
        "vm_id": vm_id,
        "kernel": images.kernel,
        "rootfs": images.rootfs,
        "initrd": images.initrd,
        "vcpus": 2,
        "memory_mib": 256,
        "agent_token": "tok-123",
        "free_page_reporting": True,  # as the driver boots it, so restores match
    }
    return VMConfig(**(fields | changes))


def processes_mentioning(text: str) -> list[int]:
    """Processes whose command line or environment names `text` (the launchers export the
    request log's path, under the test's tmp_path)."""
    found = []
    marker = text.encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                proc = Path("/proc", entry)
                if (
                    marker
                    in proc.joinpath("cmdline").read_bytes() + proc.joinpath("environ").read_bytes()
                ):
                    found.append(int(entry))
    return found


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


async def echo_through_agent(vm: FirecrackerVM) -> None:
    reader, writer = await vm.open_agent_stream()
    try:
        writer.write(b"ping from the host")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(18), 5) == b"ping from the host"
    finally:
        writer.close()
        await writer.wait_closed()


@contextlib.asynccontextmanager
async def closing(vm: FirecrackerVM) -> AsyncIterator[FirecrackerVM]:
    try:
        yield vm
    finally:
        await vm.close()


# --- the spec and the validator ------------------------------------------------------------------


def test_spec_is_the_published_firecracker_api(spec: Spec) -> None:
    assert spec.version == "1.16.1"
    assert ("PUT", "/snapshot/load") in spec.operations()
    assert len(spec.operations()) >= 30


def test_missing_spec_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(SpecMissingError, match=r"spec not found at .*SPACE_FIRECRACKER_SPEC"):
        Spec(tmp_path / "nowhere.yaml")


async def test_fake_refuses_to_run_without_the_spec(tmp_path: Path) -> None:
    launcher = write_launcher(tmp_path / "fake-firecracker", {SPEC_ENV: str(tmp_path / "x")})
    process = await asyncio.create_subprocess_exec(
        str(launcher),
        "--api-sock",
        str(tmp_path / "api.sock"),
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    _, stderr = await process.communicate()
    assert process.returncode == 3
    assert b"spec not found" in stderr


@pytest.mark.parametrize(
    ("method", "path", "body", "complaint"),
    [
        ("PUT", "/machine-config", {"vcpu_count": 0, "mem_size_mib": 256}, "less than the minimum"),
        ("PUT", "/machine-config", {"vcpu_count": 33, "mem_size_mib": 256}, "greater than the max"),
        ("PUT", "/machine-config", {"vcpu_count": 1}, "'mem_size_mib' is a required property"),
        ("PUT", "/machine-config", {"vcpu_count": 1.0, "mem_size_mib": 9}, "is not of type"),
        ("PATCH", "/vm", {"state": "Frozen"}, "is not one of ['Paused', 'Resumed']"),
        ("PUT", "/actions", {"action_type": "Reboot"}, "is not one of"),
        ("PUT", "/vsock", {"guest_cid": 2, "uds_path": "v.sock"}, "less than the minimum of 3"),
        ("PUT", "/logger", {"log_path": "x", "colour": True}, "'colour' was unexpected"),
        (
            "PUT",
            "/drives/rootfs",
            {"drive_id": "rootfs", "is_root_device": True, "io_engine": "Turbo"},
            "'Turbo' is not one of",
        ),
        ("PUT", "/drives/a", {"drive_id": "b", "is_root_device": True}, "does not match"),
        (
            "PUT",
            "/snapshot/load",
            {"snapshot_path": "s", "mem_backend": {"backend_type": "Disk", "backend_path": "m"}},
            "'Disk' is not one of ['File', 'Uffd']",
        ),
        ("PUT", "/snapshot/load", {"snapshot_path": "s"}, "exactly one of mem_backend"),
        (
            "PUT",
            "/snapshot/load",
            {
                "snapshot_path": "s",
                "mem_backend": {"backend_type": "File", "backend_path": "m"},
                "network_overrides": [{"iface_id": "eth0"}],
            },
            "'host_dev_name' is a required property",
        ),
        ("PUT", "/boot-source", None, "needs a JSON body"),
        ("DELETE", "/vm", None, "DELETE is not allowed on /vm"),
        ("GET", "/snapshots", None, "not in the Firecracker API"),
        ("GET", "/version", {"please": 1}, "takes no body"),
    ],
)
def test_validator_catches_what_the_spec_forbids(
    spec: Spec, method: str, path: str, body: Any, complaint: str
) -> None:
    raw = b"" if body is None else json.dumps(body).encode()
    problems = spec.check_request(method, path, raw)
    assert any(complaint in p for p in problems), problems


def test_validator_accepts_valid_requests(spec: Spec) -> None:
    valid = [
        ("PUT", "/machine-config", {"vcpu_count": 2, "mem_size_mib": 256, "smt": False}),
        ("PATCH", "/vm", {"state": "Paused"}),
        ("PUT", "/mmds", {"anything": {"goes": ["here"]}}),
        ("GET", "/", None),
    ]
    for method, path, body in valid:
        raw = b"" if body is None else json.dumps(body).encode()
        assert spec.check_request(method, path, raw) == []


# --- the client against the spec ---------------------------------------------------------------

RATE = {"bandwidth": {"size": 1 << 20, "refill_time": 100}, "ops": {"size": 100, "refill_time": 10}}
CLIENT_SAMPLES: dict[str, dict[str, Any]] = {
    "get_instance_info": {},
    "get_version": {},
    "get_vm_config": {},
    "action": {"action_type": "FlushMetrics"},
    "instance_start": {},
    "send_ctrl_alt_del": {},
    "flush_metrics": {},
    "patch_vm_state": {"state": "Resumed"},
    "pause": {},
    "resume": {},
    "get_machine_config": {},
    "put_machine_config": {
        "config": {"vcpu_count": 2, "mem_size_mib": 512, "smt": False, "huge_pages": "2M"}
    },
    "patch_machine_config": {
        "config": {"vcpu_count": 1, "mem_size_mib": 128, "track_dirty_pages": True}
    },
    "put_cpu_config": {
        "config": {
            "kvm_capabilities": ["!121"],
            "cpuid_modifiers": [
                {
                    "leaf": "0x1",
                    "subleaf": "0x0",
                    "flags": 0,
                    "modifiers": [{"register": "ecx", "bitmap": "0b" + "x" * 31 + "0"}],
                }
            ],
            "msr_modifiers": [{"addr": "0x10a", "bitmap": "0b" + "0" * 64}],
        }
    },
    "put_boot_source": {
        "boot_source": {"kernel_image_path": "vmlinux", "boot_args": "ro", "initrd_path": "i"}
    },
    "put_drive": {
        "drive": {
            "drive_id": "data_1",
            "path_on_host": "data.img",
            "is_root_device": False,
            "is_read_only": True,
            "cache_type": "Writeback",
            "io_engine": "Async",
            "rate_limiter": RATE,
        }
    },
    "patch_drive": {"drive": {"drive_id": "data_1", "path_on_host": "other.img"}},
    "put_pmem": {"pmem": {"id": "pm0", "path_on_host": "pm.img", "read_only": True}},
    "patch_pmem": {"pmem": {"id": "pm0", "rate_limiter": RATE}},
    "put_network_interface": {
        "iface": {"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": MAC, "mtu": 1500}
    },
    "patch_network_interface": {"iface": {"iface_id": "eth0", "rx_rate_limiter": RATE}},
    "put_vsock": {"vsock": {"guest_cid": 3, "uds_path": "vsock.sock"}},
    "put_entropy": {"entropy": {"rate_limiter": RATE}},
    "put_serial": {"serial": {"serial_out_path": "console.log", "rate_limiter": RATE["bandwidth"]}},
    "put_balloon": {
        "balloon": {"amount_mib": 64, "deflate_on_oom": True, "stats_polling_interval_s": 1}
    },
    "patch_balloon": {"update": {"amount_mib": 32}},
    "get_balloon": {},
    "get_balloon_statistics": {},
    "patch_balloon_statistics": {"update": {"stats_polling_interval_s": 5}},
    "start_balloon_hinting": {"command": {"acknowledge_on_stop": True}},
    "get_balloon_hinting_status": {},
    "stop_balloon_hinting": {},
    "put_memory_hotplug": {"config": {"total_size_mib": 1024, "slot_size_mib": 128}},
    "patch_memory_hotplug": {"update": {"requested_size_mib": 256}},
    "get_memory_hotplug": {},
    "put_logger": {"logger": {"log_path": "fc.log", "level": "Debug", "show_level": True}},
    "put_metrics": {"metrics": {"metrics_path": "metrics.json"}},
    "put_mmds": {"contents": {"latest": {"meta-data": {"id": "x"}}}},
    "patch_mmds": {"contents": {"latest": {"user-data": "y"}}},
    "get_mmds": {},
    "put_mmds_config": {
        "config": {"network_interfaces": ["eth0"], "version": "V2", "ipv4_address": "169.254.1.1"}
    },
    "create_snapshot": {
        "params": {"snapshot_path": "s", "mem_file_path": "m", "snapshot_type": "Diff"}
    },
    "load_snapshot": {
        "params": {
            "snapshot_path": "s",
            "mem_backend": {"backend_type": "Uffd", "backend_path": "uffd.sock"},
            "track_dirty_pages": True,
            "resume_vm": False,
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap9"}],
            "vsock_override": {"uds_path": "v2.sock"},
            "clock_realtime": True,
        }
    },
}
NOT_API_CALLS = {"wait_ready", "request", "aclose", "__aenter__", "__aexit__"}


async def test_every_client_request_is_in_the_spec_and_covers_it(spec: Spec) -> None:
    methods = {
        name
        for name, _ in inspect.getmembers(FirecrackerClient, inspect.iscoroutinefunction)
        if name not in NOT_API_CALLS
    }
    assert methods == set(CLIENT_SAMPLES), "every client call needs a sample here"
    sent: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return httpx.Response(200, json={}) if request.method == "GET" else httpx.Response(204)

    client = FirecrackerClient(Path("/nonexistent"), transport=httpx.MockTransport(answer))
    hit: set[tuple[str, str]] = set()
    async with client:
        for name, kwargs in CLIENT_SAMPLES.items():
            before = len(sent)
            await getattr(client, name)(**kwargs)
            assert len(sent) == before + 1, f"{name} sent {len(sent) - before} requests"
            request = sent[-1]
            raw_path = request.url.raw_path.decode()
            problems = spec.check_request(request.method, raw_path, request.content)
            assert problems == [], f"{name}: {request.method} {raw_path}: {problems}"
            routed = spec.route(raw_path)
            assert routed is not None
            hit.add((request.method, routed[0]))
    assert hit == spec.operations(), f"not covered: {spec.operations() - hit}"


async def test_invalid_calls_are_refused_by_the_validating_fake(fake: Fake, tmp_path: Path) -> None:
    socket_path = tmp_path / "api.sock"
    process = await asyncio.create_subprocess_exec(
        str(fake.firecracker),
        "--api-sock",
        str(socket_path),
        "--id",
        "direct",
        start_new_session=True,
    )
    try:
        async with FirecrackerClient(socket_path) as client:
            await client.wait_ready(10)
            with pytest.raises(FirecrackerAPIError) as bad_count:
                await client.put_machine_config({"vcpu_count": 0, "mem_size_mib": 256})
            assert bad_count.value.status == 400
            assert "vcpu_count: 0 is less than the minimum of 1" in bad_count.value.fault_message
            assert "PUT /machine-config" in str(bad_count.value)
            with pytest.raises(FirecrackerAPIError, match="'Frozen' is not one of"):
                await client.patch_vm_state(cast(Any, "Frozen"))
            with pytest.raises(FirecrackerAPIError, match="'vcpus' was unexpected"):
                await client.put_machine_config(
                    cast(Any, {"vcpu_count": 1, "mem_size_mib": 128, "vcpus": 2})
                )
            # Valid by the schema, refused by Firecracker's rules: snapshots need a paused VM.
            with pytest.raises(FirecrackerAPIError, match="before starting"):
                await client.create_snapshot({"snapshot_path": "s", "mem_file_path": "m"})
            assert (await client.get_instance_info())["state"] == "Not started"
    finally:
        process.kill()
        await process.wait()
        socket_path.unlink(missing_ok=True)
    kinds = [(r["path"], r["problem"]["kind"]) for r in fake.problems()]
    assert kinds == [
        ("/machine-config", "spec"),
        ("/vm", "spec"),
        ("/machine-config", "spec"),
        ("/snapshot/create", "state"),
    ]


# --- the driver: boot, pause, resume --------------------------------------------------------------

BOOT_CALLS = [
    ("PUT", "/logger"),
    ("PUT", "/metrics"),
    ("PUT", "/machine-config"),
    ("PUT", "/boot-source"),
    ("PUT", "/drives/rootfs"),
    ("PUT", "/vsock"),
    ("PUT", "/entropy"),
    ("PUT", "/balloon"),
    ("PUT", "/actions"),
]


async def test_boot_sends_the_spec_requests_in_order(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run-a"
    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images), run_dir)
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        assert vm.status().state is VMState.RUNNING
        assert fake.calls(pid) == BOOT_CALLS
        assert fake.body(pid, "PUT", "/machine-config") == {
            "vcpu_count": 2,
            "mem_size_mib": 256,
            "smt": False,
        }
        boot = fake.body(pid, "PUT", "/boot-source")
        assert boot["kernel_image_path"] == "vmlinux"
        assert boot["initrd_path"] == "initrd"
        args = boot["boot_args"].split()
        assert "console=ttyS0" in args and "space.token=tok-123" in args
        assert args[-2:] == ["reboot=k", "pci=off"]
        assert fake.body(pid, "PUT", "/drives/rootfs") == {
            "drive_id": "rootfs",
            "path_on_host": "rootfs",
            "is_root_device": True,
            "is_read_only": False,
        }
        assert fake.body(pid, "PUT", "/vsock") == {"guest_cid": 3, "uds_path": "vsock.sock"}
        # A balloon that is never inflated: it only takes back the pages the guest frees.
        assert fake.body(pid, "PUT", "/balloon") == {
            "amount_mib": 0,
            "deflate_on_oom": False,
            "free_page_reporting": True,
        }
        assert fake.body(pid, "PUT", "/actions") == {"action_type": "InstanceStart"}
        logger = fake.body(pid, "PUT", "/logger")
        assert logger["log_path"] == "firecracker.log"
        # Relative names resolve in run_dir, through links to the caller's files.
        start = fake.start(pid)
        assert start["cwd"] == str(run_dir)
        assert start["sid"] == pid, "the VMM must lead its own session"
        assert start["argv"] == ["--api-sock", "firecracker.socket", "--id", "vm-a"]
        assert (run_dir / "rootfs").resolve() == images.rootfs
        assert (run_dir / "vmlinux").resolve() == images.kernel
        assert "InstanceStart" in vm.console_text()
        assert vm.console_log == run_dir / "console.log"

        async with FirecrackerClient(vm.api_socket) as client:
            await vm.pause()
            assert vm.status().state is VMState.PAUSED
            assert (await client.get_instance_info())["state"] == "Paused"
            await vm.pause()  # already paused: nothing sent
            await vm.resume()
            assert vm.status().state is VMState.RUNNING
            assert (await client.get_instance_info())["state"] == "Running"
        assert fake.calls(pid)[len(BOOT_CALLS) :] == [
            ("PATCH", "/vm"),
            ("GET", "/"),
            ("PATCH", "/vm"),
            ("GET", "/"),
        ]
        await echo_through_agent(vm)
    assert fake.problems() == []


async def test_boot_with_a_tap_device_adds_the_network_interface(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    config = make_config(images, tap_device="tap-a", guest_mac=MAC, initrd=None)
    vm = await FirecrackerDriver(fake.firecracker).boot(config, tmp_path / "run")
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        calls = fake.calls(pid)
        assert calls == [*BOOT_CALLS[:5], ("PUT", "/network-interfaces/eth0"), *BOOT_CALLS[5:]]
        assert fake.body(pid, "PUT", "/network-interfaces/eth0") == {
            "iface_id": "eth0",
            "host_dev_name": "tap-a",
            "guest_mac": MAC,
        }
        assert "initrd_path" not in fake.body(pid, "PUT", "/boot-source")
    assert fake.problems() == []


async def test_boot_with_extra_drives_adds_them_by_name(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    volume = tmp_path / "volume.img"
    volume.write_bytes(b"\0" * 4096)
    drives = (Drive(volume, "vol-a", read_only=True), Drive(images.rootfs, "empty1"))
    config = make_config(images, drives=drives, initrd=None)
    vm = await FirecrackerDriver(fake.firecracker).boot(config, tmp_path / "run")
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        for i, read_only in enumerate((True, False)):
            assert fake.body(pid, "PUT", f"/drives/drive{i}") == {
                "drive_id": f"drive{i}",
                "path_on_host": f"drive{i}",
                "is_root_device": False,
                "is_read_only": read_only,
            }
        # The VMM finds each drive under its fixed name, so a restore can swap the file.
        assert (tmp_path / "run" / "drive0").samefile(volume)
    assert fake.problems() == []
    assert volume.read_bytes() == b"\0" * 4096  # the caller's volume outlives the VM


async def test_every_drive_gets_the_disk_share_as_a_rate_limiter(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    """The worker's disk share reaches each drive as Firecracker's token buckets (the spec's
    RateLimiter), and a share of 0 sends none."""
    drives = (Drive(images.rootfs, "vol-a", read_only=True),)
    config = make_config(images, drives=drives, initrd=None)
    shares = Shares(disk_mib_s=64, disk_iops=1000, net_mbit=0)
    vm = await FirecrackerDriver(fake.firecracker, shares=shares).boot(config, tmp_path / "run")
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        for path in ("/drives/rootfs", "/drives/drive0"):
            assert fake.body(pid, "PUT", path)["rate_limiter"] == {
                "bandwidth": {"size": 64 << 20, "refill_time": 1000},
                "ops": {"size": 1000, "refill_time": 1000},
            }
    unlimited = FirecrackerDriver(fake.firecracker, shares=Shares(0, 0, 0))
    vm = await unlimited.boot(config, tmp_path / "run2")
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        assert "rate_limiter" not in fake.body(pid, "PUT", "/drives/rootfs")
    assert fake.problems() == []


async def test_boot_refuses_bad_input_before_starting_anything(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    driver = FirecrackerDriver(fake.firecracker)
    with pytest.raises(InvalidInstanceIdError, match="only ASCII letters, digits and '-'"):
        await driver.boot(make_config(images, vm_id="vm_a"), tmp_path / "r1")
    with pytest.raises(VMMError, match="1 to 32 vCPUs"):
        await driver.boot(make_config(images, vcpus=33), tmp_path / "r2")
    with pytest.raises(VMMError, match=r"rootfs .* does not exist"):
        await driver.boot(make_config(images, rootfs=tmp_path / "none.img"), tmp_path / "r3")
    missing = FirecrackerDriver(tmp_path / "no-such-firecracker")
    with pytest.raises(VMMError, match=r"Firecracker binary .* not found"):
        await missing.boot(make_config(images), tmp_path / "r4")
    assert fake.records() == []
    assert not any((tmp_path / f"r{i}").exists() for i in range(1, 5))


async def test_a_vmm_that_dies_at_start_is_reported_with_what_it_said(
    images: Images, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-firecracker"
    broken.write_text("#!/bin/sh\necho 'Error: unsupported host CPU' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(VMGone) as failure:
        await FirecrackerDriver(broken).boot(make_config(images), tmp_path / "run")
    message = str(failure.value)
    assert "exited with code 3" in message
    assert "unsupported host CPU" in message
    assert not (tmp_path / "run").exists()


async def test_a_request_refused_during_boot_fails_the_boot_cleanly(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    driver = FirecrackerDriver(fake.firecracker, log_level=cast(Any, "Loud"))
    with pytest.raises(VMMError) as failure:
        await driver.boot(make_config(images), tmp_path / "run")
    assert not isinstance(failure.value, VMGone)
    assert "Firecracker refused PUT /logger (HTTP 400)" in str(failure.value)
    assert "'Loud' is not one of" in str(failure.value)
    assert [r["problem"]["kind"] for r in fake.problems()] == ["spec"]
    assert not (tmp_path / "run").exists()
    assert processes_mentioning(str(tmp_path)) == []


# --- snapshots and restore ---------------------------------------------------------------------


async def test_snapshot_then_restore_elsewhere_with_overrides(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    driver = FirecrackerDriver(fake.firecracker)
    config_a = make_config(images, tap_device="tap-a", guest_mac=MAC)
    vm_a = await driver.boot(config_a, tmp_path / "run-a")
    dest = tmp_path / "snapshots" / "snap-1"
    async with closing(vm_a):
        pid_a = vm_a.status().pid
        assert pid_a is not None
        info = await vm_a.snapshot(dest)
        assert vm_a.status().state is VMState.PAUSED, "a snapshot leaves the VM paused"
        assert fake.calls(pid_a)[-2:] == [("PATCH", "/vm"), ("PUT", "/snapshot/create")]
        assert fake.body(pid_a, "PATCH", "/vm") == {"state": "Paused"}
        assert fake.body(pid_a, "PUT", "/snapshot/create") == {
            "snapshot_path": str(dest / "vmstate"),
            "mem_file_path": str(dest / "memory"),
            "snapshot_type": "Full",
        }
        # ext4 here: no reflink, and the driver says it made a full copy.
        assert vm_a.last_snapshot_disk_copy in ("reflink", "copy")
        with pytest.raises(VMMError, match="already holds snapshot files"):
            await vm_a.snapshot(dest)
    assert not (tmp_path / "run-a").exists(), "closing A removed its run_dir"

    loaded = SnapshotInfo.load(dest)
    assert loaded.files == {"state": "vmstate", "memory": "memory", "disk": "disk.img"}
    assert loaded.config == config_a
    assert loaded.driver == "firecracker"
    assert info.took_s > 0
    assert (dest / "disk.img").read_bytes() == images.rootfs.read_bytes()
    assert stat.S_IMODE((dest / "snapshot.json").stat().st_mode) == 0o600

    disk_b = tmp_path / "disks" / "b.img"
    disk_b.parent.mkdir()
    clone_file(dest / "disk.img", disk_b)
    config_b = config_a.with_changes(vm_id="vm-b", rootfs=disk_b, tap_device="tap-b")
    vm_b = await driver.restore(loaded, config_b, tmp_path / "run-b")
    async with closing(vm_b):
        pid_b = vm_b.status().pid
        assert pid_b is not None
        assert fake.calls(pid_b) == [
            ("PUT", "/logger"),
            ("PUT", "/metrics"),
            ("PUT", "/snapshot/load"),
        ]
        assert fake.body(pid_b, "PUT", "/snapshot/load") == {
            "snapshot_path": str(dest / "vmstate"),
            "mem_backend": {"backend_type": "File", "backend_path": str(dest / "memory")},
            "resume_vm": True,
            "vsock_override": {"uds_path": "vsock.sock"},
            "network_overrides": [{"iface_id": "eth0", "host_dev_name": "tap-b"}],
        }
        # The snapshot names the disk "rootfs"; B's process opened B's own disk, A is gone.
        assert (tmp_path / "run-b" / "rootfs").resolve() == disk_b
        assert vm_b.status().state is VMState.RUNNING
        await echo_through_agent(vm_b)

    same_tap = config_a.with_changes(vm_id="vm-c", rootfs=disk_b)
    vm_c = await driver.restore(loaded, same_tap, tmp_path / "run-c")
    async with closing(vm_c):
        assert vm_c.status().pid is not None
        body = fake.body(vm_c.status().pid or 0, "PUT", "/snapshot/load")
        assert "network_overrides" not in body
    assert fake.problems() == []


async def test_restore_refuses_a_different_machine(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    driver = FirecrackerDriver(fake.firecracker)
    vm = await driver.boot(make_config(images), tmp_path / "run-a")
    async with closing(vm):
        info = await vm.snapshot(tmp_path / "snap")
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"vcpus": 4}, "vcpus 4 != 2"),
        ({"memory_mib": 512}, "memory_mib 512 != 256"),
        ({"tap_device": "tap-x"}, "a network device is added"),
        ({"free_page_reporting": False}, "free_page_reporting False != True"),
        ({"rootfs": tmp_path / "missing.img"}, "does not exist"),
    ]
    for changes, complaint in refusals:
        config = make_config(images, vm_id="vm-x", **changes)
        with pytest.raises(VMMError, match=complaint):
            await driver.restore(info, config, tmp_path / "run-x")
    starts = [r for r in fake.records() if r.get("event") == "start"]
    assert len(starts) == 1, "no process was started for a refused restore"
    assert fake.problems() == []


# --- ending a VM ---------------------------------------------------------------------------------


async def test_stop_asks_the_guest_and_cleans_up(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images), run_dir)
    pid = vm.status().pid
    assert pid is not None
    await vm.pause()
    status = await vm.stop(timeout=5)
    assert status.state is VMState.STOPPED
    assert status.exit_code == 0
    assert status.reason == "shut down on request"
    assert fake.calls(pid)[-2:] == [("PATCH", "/vm"), ("PUT", "/actions")]
    assert fake.requests(pid)[-1]["body"] == {"action_type": "SendCtrlAltDel"}
    assert fake.requests(pid)[-2]["body"] == {"state": "Resumed"}
    assert not run_dir.exists()
    assert processes_mentioning(str(tmp_path)) == []
    assert images.rootfs.read_bytes().startswith(b"rootfs of vm-a")
    with pytest.raises(VMGone):
        await vm.resume()
    assert (await vm.stop()).state is VMState.STOPPED  # idempotent
    assert fake.problems() == []


async def test_stop_kills_a_vmm_that_ignores_ctrl_alt_del(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    vm = await FirecrackerDriver(fake.deaf_firecracker).boot(make_config(images), tmp_path / "r")
    status = await vm.stop(timeout=0.3)
    assert status.state is VMState.STOPPED
    assert status.exit_code == -signal.SIGKILL
    assert status.reason is not None and "killed" in status.reason
    assert processes_mentioning(str(tmp_path)) == []
    assert not (tmp_path / "r").exists()


async def test_kill_ends_the_process_group_and_cleans_up(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images), tmp_path / "r")
    status = await vm.kill()
    assert status.state is VMState.STOPPED
    assert status.exit_code == -signal.SIGKILL
    assert status.reason == "killed on request"
    assert processes_mentioning(str(tmp_path)) == []
    assert not (tmp_path / "r").exists()
    assert images.rootfs.exists()


async def test_a_vmm_killed_from_outside_is_seen_as_crashed(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images), run_dir)
    pid = vm.status().pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    status = await asyncio.wait_for(vm.wait(), 10)
    assert status.state is VMState.CRASHED
    assert status.reason == "VMM process killed by signal 9 (SIGKILL)"
    assert status.exit_code == -9
    with pytest.raises(VMGone, match="signal 9"):
        await vm.pause()
    with pytest.raises(VMGone):
        await vm.open_agent_stream()
    assert run_dir.exists(), "a crashed VM keeps its files until closed"
    await vm.close()
    assert not run_dir.exists()
    assert vm.status().state is VMState.CRASHED


async def test_close_leaves_no_process_socket_file_or_descriptor(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    marker = str(tmp_path)
    processes_before = processes_mentioning(marker)
    fds_before = len(os.listdir("/proc/self/fd"))
    images_before = files_under(images.rootfs.parent)
    run_dir = tmp_path / "vms" / "vm-a"
    run_dir.parent.mkdir()

    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images), run_dir)
    await echo_through_agent(vm)
    await vm.snapshot(tmp_path / "snap")
    during = files_under(run_dir)
    assert {"firecracker.socket", "vsock.sock", "console.log", "rootfs", "vmlinux"} <= set(during)
    assert len(processes_mentioning(marker)) == len(processes_before) + 1
    await vm.close()

    assert processes_mentioning(marker) == processes_before
    assert not run_dir.exists()
    assert files_under(run_dir.parent) == []
    assert files_under(images.rootfs.parent) == images_before
    await asyncio.sleep(0)  # let closed transports release their sockets
    assert len(os.listdir("/proc/self/fd")) == fds_before
    assert files_under(tmp_path / "snap") == ["disk.img", "memory", "snapshot.json", "vmstate"]


async def test_run_dir_holding_the_callers_disk_keeps_it(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    # The worker may keep the disk in run_dir under the very name the driver uses.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    disk = run_dir / "rootfs"
    clone_file(images.rootfs, disk)
    vm = await FirecrackerDriver(fake.firecracker).boot(make_config(images, rootfs=disk), run_dir)
    await vm.close()
    assert disk.is_file() and not disk.is_symlink()
    assert files_under(run_dir) == ["rootfs"]
    assert fake.problems() == []


# --- the jailer: command line and chroot layout ------------------------------------------------


@pytest.fixture
def binaries(tmp_path: Path) -> tuple[Path, Path]:
    directory = tmp_path / "usr-bin"
    directory.mkdir()
    firecracker = directory / "firecracker-v1.16.1-x86_64"
    jailer = directory / "jailer"
    for path in (firecracker, jailer):
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(0o755)
    (directory / "firecracker").symlink_to(firecracker.name)
    return firecracker, jailer


def test_jailer_argv(binaries: tuple[Path, Path], tmp_path: Path) -> None:
    firecracker, jailer = binaries
    base = tmp_path / "srv-jailer"
    config = JailerConfig(
        id="vm-1",
        firecracker_binary=firecracker.parent / "firecracker",  # a symlink, as often installed
        jailer_binary=jailer,
        uid=1000,
        gid=1001,
        chroot_base_dir=base,
        netns=Path("/var/run/netns/sbx-1"),
        cgroups={"cpu.max": "50000 100000", "memory.max": "536870912"},
        parent_cgroup="space",
        resource_limits={"fsize": 1 << 30, "no-file": 1024},
        daemonize=True,
    )
    assert jailer_argv(config, ["--level", "Info"]) == [
        str(jailer),
        "--id",
        "vm-1",
        "--exec-file",
        str(firecracker),
        "--uid",
        "1000",
        "--gid",
        "1001",
        "--chroot-base-dir",
        str(base.resolve()),
        "--cgroup-version",
        "2",
        "--parent-cgroup",
        "space",
        "--netns",
        "/var/run/netns/sbx-1",
        "--cgroup",
        "cpu.max=50000 100000",
        "--cgroup",
        "memory.max=536870912",
        "--resource-limit",
        "fsize=1073741824",
        "--resource-limit",
        "no-file=1024",
        "--daemonize",
        "--",
        "--api-sock",
        "/run/firecracker.socket",
        "--level",
        "Info",
    ]
    # The jailer names the jail after the resolved exec file, not the symlink.
    assert chroot_root(config) == base.resolve() / firecracker.name / "vm-1" / "root"
    assert jail_dir(config) == chroot_root(config).parent
    with pytest.raises(JailerError, match="passes --id"):
        jailer_argv(config, ["--id", "other"])


@pytest.mark.parametrize("bad_id", ["", "a" * 65, "vm_1", "vm/1", "vm 1", "..", "vm.1", "vmé"])
def test_instance_ids_the_jailer_refuses(bad_id: str) -> None:
    with pytest.raises(InvalidInstanceIdError, match="invalid Firecracker instance id"):
        validate_instance_id(bad_id)


def test_instance_ids_the_jailer_accepts() -> None:
    for good in ("a" * 64, "VM-1-abc", "0"):
        validate_instance_id(good)


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"id": "bad_id"}, "invalid Firecracker instance id"),
        ({"uid": -1}, "uid must be a non-negative integer"),
        ({"cgroup_version": 3}, "cgroup_version must be 1 or 2"),
        ({"cgroups": {"cpumax": "1"}}, "invalid cgroup file"),
        ({"cgroups": {"cpu.max": "a=b"}}, "contain no '='"),
        ({"cgroups": {"cpu.max": ""}}, "non-empty"),
        ({"resource_limits": {"nproc": 10}}, "unknown resource limit 'nproc'"),
        ({"resource_limits": {"fsize": -1}}, "non-negative"),
        ({"parent_cgroup": "/abs"}, "relative path"),
        ({"parent_cgroup": "a/../b"}, "relative path"),
    ],
)
def test_jailer_config_validation(
    binaries: tuple[Path, Path], changes: dict[str, Any], complaint: str
) -> None:
    firecracker, jailer = binaries
    fields: dict[str, Any] = {
        "id": "vm-1",
        "firecracker_binary": firecracker,
        "jailer_binary": jailer,
        "uid": 1,
        "gid": 1,
        **changes,
    }
    with pytest.raises(JailerError, match=complaint):
        JailerConfig(**fields)


def test_jailer_binaries_are_checked(binaries: tuple[Path, Path], tmp_path: Path) -> None:
    firecracker, jailer = binaries
    renamed = tmp_path / "vmm"
    renamed.write_text("#!/bin/sh\n")
    renamed.chmod(0o755)
    config = JailerConfig(id="vm-1", firecracker_binary=renamed, jailer_binary=jailer, uid=1, gid=1)
    with pytest.raises(JailerError, match="contains 'firecracker'"):
        jailer_argv(config)
    config = JailerConfig(
        id="vm-1", firecracker_binary=firecracker, jailer_binary=tmp_path / "nojailer", uid=1, gid=1
    )
    with pytest.raises(JailerError, match=r"jailer binary .* not found"):
        jailer_argv(config)


@as_root
def test_chroot_layout_links_and_owns_files(binaries: tuple[Path, Path], tmp_path: Path) -> None:
    firecracker, jailer = binaries
    config = JailerConfig(
        id="vm-1",
        firecracker_binary=firecracker,
        jailer_binary=jailer,
        uid=JAIL_UID,
        gid=JAIL_GID,
        chroot_base_dir=tmp_path / "jails",
    )
    (tmp_path / "jails").mkdir()
    root = prepare_jail(config)
    assert root == tmp_path.resolve() / "jails" / firecracker.name / "vm-1" / "root"
    with pytest.raises(JailerError, match="already exists"):
        prepare_jail(config)

    disk = tmp_path / "disk.img"
    disk.write_bytes(b"disk")
    kernel = tmp_path / "vmlinux"
    kernel.write_bytes(b"kernel")
    kernel.chmod(0o644)
    secret_initrd = tmp_path / "initrd"
    secret_initrd.write_bytes(b"initrd")
    secret_initrd.chmod(0o600)

    placed = place_file(config, disk, "rootfs", writable=True)
    assert placed.method == "hardlink" and placed.jailed_path == "/rootfs"
    assert (root / "rootfs").stat().st_ino == disk.stat().st_ino
    assert (disk.stat().st_uid, disk.stat().st_gid) == (JAIL_UID, JAIL_GID)

    placed = place_file(config, kernel, "vmlinux", writable=False)
    assert placed.method == "hardlink"
    assert (root / "vmlinux").stat().st_ino == kernel.stat().st_ino
    assert kernel.stat().st_uid == 0, "a shared, world-readable kernel is not handed over"

    placed = place_file(config, secret_initrd, "initrd", writable=False)
    assert placed.method in ("reflink", "copy")
    copy = (root / "initrd").stat()
    assert copy.st_ino != secret_initrd.stat().st_ino
    assert (copy.st_uid, copy.st_gid) == (JAIL_UID, JAIL_GID)
    assert secret_initrd.stat().st_uid == 0
    assert (root / "initrd").read_bytes() == b"initrd"

    with pytest.raises(JailerError, match="plain file name"):
        place_file(config, kernel, "../escape", writable=False)


@as_root
def test_chroot_layout_across_file_systems(binaries: tuple[Path, Path], tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a file system other than tmp_path's")
    firecracker, jailer = binaries
    config = JailerConfig(
        id="vm-x",
        firecracker_binary=firecracker,
        jailer_binary=jailer,
        uid=JAIL_UID,
        gid=JAIL_GID,
        chroot_base_dir=tmp_path,
    )
    root = prepare_jail(config)
    elsewhere = shm / f"space-contract-{os.getpid()}"
    elsewhere.mkdir()
    try:
        kernel = elsewhere / "vmlinux"
        kernel.write_bytes(b"kernel")
        kernel.chmod(0o644)
        placed = place_file(config, kernel, "vmlinux", writable=False)
        assert placed.method == "copy"
        assert (root / "vmlinux").stat().st_uid == JAIL_UID
        disk = elsewhere / "disk.img"
        disk.write_bytes(b"disk")
        with pytest.raises(JailerError, match="same file system"):
            place_file(config, disk, "rootfs", writable=True)
    finally:
        for path in elsewhere.iterdir():
            path.unlink()
        elsewhere.rmdir()


def test_clone_file_keeps_holes(tmp_path: Path) -> None:
    source = tmp_path / "sparse.img"
    with open(source, "wb") as out:
        out.write(b"head")
        out.seek(40 << 20)
        out.write(b"tail")
        out.truncate(64 << 20)
    dest = tmp_path / "copy.img"
    method = clone_file(source, dest)
    assert method in ("reflink", "copy")
    assert dest.read_bytes() == source.read_bytes()
    assert dest.stat().st_blocks * 512 < 1 << 20, "the copy stayed sparse"
    with pytest.raises(FileExistsError):
        clone_file(source, dest)


# --- the driver, jailed (through the fake jailer) ----------------------------------------------


def jailed(fake: Fake, base: Path, **extra: Any) -> Callable[[VMConfig], JailerConfig]:
    base.mkdir(exist_ok=True)

    def build(config: VMConfig) -> JailerConfig:
        return JailerConfig(
            id=config.vm_id,
            firecracker_binary=fake.firecracker,
            jailer_binary=fake.jailer,
            chroot_base_dir=base,
            resource_limits={"no-file": 4096},
            **{"uid": JAIL_UID, "gid": JAIL_GID, **extra},
        )

    return build


@as_root
async def test_jailed_boot_snapshot_restore(fake: Fake, images: Images, tmp_path: Path) -> None:
    factory = jailed(fake, tmp_path / "jails")
    driver = FirecrackerDriver(jailer=factory)
    config = make_config(images)
    jail = factory(config)
    root = chroot_root(jail)
    vm = await driver.boot(config, tmp_path / "run-a")
    dest = tmp_path / "snap"
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        jailer_record = next(r for r in fake.records() if r.get("event") == "jailer")
        assert jailer_record["argv"] == jailer_argv(jail)[1:]
        start = fake.start(pid)
        assert start["cwd"] == str(root)
        assert start["sid"] == pid
        assert start["argv"][start["argv"].index("--id") + 1] == "vm-a"
        assert vm.api_socket == root / "run" / "firecracker.socket"
        # Same relative names as outside the jail: the bodies do not depend on the jail.
        assert fake.calls(pid) == BOOT_CALLS
        assert fake.body(pid, "PUT", "/drives/rootfs")["path_on_host"] == "rootfs"
        assert (root / "rootfs").stat().st_ino == images.rootfs.stat().st_ino
        assert images.rootfs.stat().st_uid == JAIL_UID
        assert (root / "firecracker.log").stat().st_uid == JAIL_UID
        assert (root / "dev" / "kvm").is_char_device()
        await echo_through_agent(vm)
        await vm.snapshot(dest)
        assert fake.body(pid, "PUT", "/snapshot/create") == {
            "snapshot_path": "snapshot/vmstate",
            "mem_file_path": "snapshot/memory",
            "snapshot_type": "Full",
        }
        assert files_under(root / "snapshot") == [], "the snapshot was moved out of the jail"
    assert not jail_dir(jail).exists()
    assert not (tmp_path / "run-a").exists()
    assert images.rootfs.stat().st_nlink == 1
    assert images.rootfs.read_bytes().startswith(b"rootfs of vm-a")
    assert files_under(dest) == ["disk.img", "memory", "snapshot.json", "vmstate"]

    disk_b = tmp_path / "b.img"
    clone_file(dest / "disk.img", disk_b)
    config_b = config.with_changes(vm_id="vm-b", rootfs=disk_b)
    vm_b = await driver.restore(SnapshotInfo.load(dest), config_b, tmp_path / "run-b")
    async with closing(vm_b):
        pid_b = vm_b.status().pid
        assert pid_b is not None
        assert fake.body(pid_b, "PUT", "/snapshot/load") == {
            "snapshot_path": "vmstate",
            "mem_backend": {"backend_type": "File", "backend_path": "memory"},
            "resume_vm": True,
            "vsock_override": {"uds_path": "vsock.sock"},
        }
        await echo_through_agent(vm_b)
    assert not jail_dir(factory(config_b)).exists()
    assert fake.problems() == []


@as_root
async def test_jailed_daemonized_vmm_logs_its_console_to_a_file(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    factory = jailed(fake, tmp_path / "jails", daemonize=True)
    vm = await FirecrackerDriver(jailer=factory).boot(make_config(images), tmp_path / "run")
    root = chroot_root(factory(vm.config))
    async with closing(vm):
        pid = vm.status().pid
        assert pid is not None
        # The jailer's own setsid() worked: we did not make it a session leader first.
        assert fake.start(pid)["sid"] == pid
        assert fake.calls(pid)[-2:] == [("PUT", "/serial"), ("PUT", "/actions")]
        assert fake.body(pid, "PUT", "/serial") == {"serial_out_path": "console.log"}
        assert vm.console_log == root / "console.log"
        assert "InstanceStart" in vm.console_text()
    assert processes_mentioning(str(tmp_path)) == []
    assert not jail_dir(factory(vm.config)).exists()
    assert fake.problems() == []


@as_root
async def test_a_jailed_vm_takes_the_sandbox_tap_in_its_namespace(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    """The worker hands the driver an fd on the sandbox's tap (opened in the sandbox's network
    namespace): the jailer is told to enter that namespace (through the worker's fd, which it
    can open after closing its own), and Firecracker to open that tap by name; the VM's uid is
    leased from the worker's range and given back once the VM is gone."""
    name = f"fc-{uuid.uuid4().hex[:8]}"
    tap = netns.create(name, lambda: open_tap_device("tap-sb"))
    uids = UidRange(2_100_000_000, 4, tmp_path / "uids")
    released: list[int] = []
    factory = jailed(fake, tmp_path / "jails", uid=uids.lease("vm-a"))
    try:
        driver = FirecrackerDriver(jailer=factory, on_release=lambda j: released.append(j.uid))
        config = make_config(images, guest_mac=MAC, tap_fd=tap, nic=True)
        vm = await driver.boot(config, tmp_path / "run")
        async with closing(vm):
            pid = vm.status().pid
            assert pid is not None
            record = next(r for r in fake.records() if r.get("event") == "jailer")
            assert record["netns_ino"] == (netns.NETNS_DIR / name).stat().st_ino
            netns_arg = record["argv"][record["argv"].index("--netns") + 1]
            assert netns_arg.startswith(f"/proc/{os.getpid()}/fd/")
            assert fake.body(pid, "PUT", "/network-interfaces/eth0") == {
                "iface_id": "eth0", "host_dev_name": "tap-sb", "guest_mac": MAC,
            }  # fmt: skip
        assert released == [factory(config).uid]
        # The driver let go of the namespace it held open for the jailer.
        held = Path(netns_arg)
        assert not held.exists() or os.readlink(held) != f"net:[{record['netns_ino']}]"
    finally:
        os.close(tap)
        netns.remove(name)
    assert fake.problems() == []


async def test_a_nic_without_a_jailer_is_refused_clearly(
    fake: Fake, images: Images, tmp_path: Path
) -> None:
    r, w = os.pipe()  # any fd: the driver refuses before it looks at it
    try:
        config = make_config(images, tap_fd=r, nic=True, tap_device="tap-sb")
        with pytest.raises(VMMError, match="takes its jailer"):
            await FirecrackerDriver(fake.firecracker).boot(config, tmp_path / "run")
    finally:
        os.close(r)
        os.close(w)
    assert processes_mentioning(str(tmp_path)) == []


# --- hybrid vsock against real unix-socket peers --------------------------------------------


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]


@contextlib.asynccontextmanager
async def vsock_peer(path: Path, handler: Handler) -> AsyncIterator[list[bytes]]:
    """A unix socket playing Firecracker's side; yields the handshake lines it received."""
    received: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            received.append(await reader.readline())
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        async with server:
            yield received
    finally:
        path.unlink(missing_ok=True)


async def test_vsock_handshake_keeps_data_sent_with_the_ok_line(tmp_path: Path) -> None:
    async def guest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"OK 1073741824\nHELLO-FROM-GUEST")  # one write: one packet
        await writer.drain()
        writer.write((await reader.readexactly(5)).upper())
        await writer.drain()

    path = tmp_path / "v.sock"
    async with vsock_peer(path, guest) as received:
        reader, writer = await connect_hybrid_vsock(path, AGENT_VSOCK_PORT)
        try:
            assert await asyncio.wait_for(reader.readexactly(16), 5) == b"HELLO-FROM-GUEST"
            writer.write(b"hello")
            await writer.drain()
            assert await asyncio.wait_for(reader.readexactly(5), 5) == b"HELLO"
        finally:
            writer.close()
            await writer.wait_closed()
    assert received == [b"CONNECT 1024\n"]


@pytest.mark.parametrize(
    ("answer", "complaint"),
    [
        (b"NOPE\n", "refused the connection.*NOPE"),
        (b"OK\n", "expected 'OK <port>'"),
        (b"OK 12 extra\n", "expected 'OK <port>'"),
        (b"OK 1", "closed during the handshake after b'OK 1'"),
        (b"", "closed during the handshake: nothing in the guest accepted vsock port 1024"),
    ],
)
async def test_vsock_handshake_failures(tmp_path: Path, answer: bytes, complaint: str) -> None:
    async def guest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        await writer.drain()

    path = tmp_path / "v.sock"
    async with vsock_peer(path, guest):
        with pytest.raises(VsockConnectError, match=complaint):
            await connect_hybrid_vsock(path, 1024)


async def test_vsock_handshake_times_out(tmp_path: Path) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    path = tmp_path / "v.sock"
    async with vsock_peer(path, silent):
        with pytest.raises(VsockConnectError, match=r"no answer to CONNECT 1024 .* within 0\.2 s"):
            await connect_hybrid_vsock(path, 1024, timeout=0.2)


async def test_vsock_without_a_socket(tmp_path: Path) -> None:
    with pytest.raises(VsockConnectError, match="cannot connect to the VM's vsock socket"):
        await connect_hybrid_vsock(tmp_path / "missing.sock", 1024)
    with pytest.raises(VsockConnectError, match="out of range"):
        await connect_hybrid_vsock(tmp_path / "missing.sock", -1)

"""The worker's duties in a guest whose root (the tenant) replaced the programs it would have run:
/bin/sh, sync, resize2fs, mount, umount, cat, cp and python3 all write a marker file and then
spew output for ever. Every duty goes through the agent's built-in calls, still works, and no
marker is ever written; a flood of output is cut off at the cap.

One boot per module: the hostile guest is made, snapshotted with two empty volume slots (as a
worker's base snapshots are) and restored with two real volumes in them, as a create does.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from space.worker.agent_client import AgentClient, AgentError, GuestVolume, TcpStream
from space.worker.local import LocalRuntime
from space.worker.machine import Machine
from space.worker.vmm.base import Drive

pytestmark = pytest.mark.vm

MARKERS = "/root/markers"
HOSTILE = ["/bin/sh", "/bin/sync", "/usr/bin/sync", "/sbin/resize2fs", "/usr/bin/python3",
           "/usr/bin/python3.11", "/usr/bin/mount", "/usr/bin/umount", "/usr/bin/cat",
           "/usr/bin/cp"]  # fmt: skip
TENANT_PYTHON = "/usr/bin/tenant-python"  # the tenant keeps a python of its own
PEM = b"-----BEGIN CERTIFICATE-----\nMIIBspace\n-----END CERTIFICATE-----\n"
# A guest service: echoes what it gets, and after our half-close its digest.
ECHO = """
import hashlib, socket, sys
srv = socket.create_server(("127.0.0.1", 0))
open("/tmp/echo.port", "w").write(str(srv.getsockname()[1]))
while True:
    conn, _ = srv.accept()
    h = hashlib.sha256()
    while data := conn.recv(65536):
        h.update(data)
        conn.sendall(data)
    conn.sendall(b"|" + h.hexdigest().encode())
    conn.close()
"""


def hostile_script(path: str) -> bytes:
    marker = f"{MARKERS}/{path.strip('/').replace('/', '_')}"
    return f'#!/usr/bin/dash\necho "$0 $*" >> {marker}\nexec /usr/bin/yes "{path} ran"\n'.encode()


@dataclass
class Guest:
    machine: Machine
    rw_image: Path
    ro_image: Path


def host_run(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, capture_output=True, check=False)


def make_volume(image: Path, size_mib: int, contents: Path | None = None) -> None:
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    extra = ["-d", str(contents)] if contents else []
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", *extra, str(image)], check=True)


@pytest.fixture(scope="module")
async def guest(
    runtime: LocalRuntime, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Guest]:
    tmp = tmp_path_factory.mktemp("duties")
    empty = tmp / "empty-slot.img"
    empty.touch()
    slots = tuple(Drive(empty, f"empty{i}", placeholder=True) for i in range(2))
    origin = await Machine.boot(runtime.driver, runtime.pool, runtime.images, drives=slots)
    snap_dir = runtime.pool.snapshots / f"test-duties-{origin.id}"
    try:
        async with origin:
            a = origin.agent
            await a.mkdir(MARKERS, parents=True)
            assert (await a.run(["ln", "/usr/bin/python3.11", TENANT_PYTHON])).ok
            assert (await a.run(["cp", "/usr/bin/mount", "/root/tenant-mount"])).ok
            for path in HOSTILE:
                await a.write_file(path, hostile_script(path), mode=0o755)
            # The traps are live: what the worker used to run now marks and floods.
            r = await a.run(["/bin/sync"], max_output=64 << 10)
            assert r.truncated and r.stdout.startswith(b"/usr/bin/sync ran\n")  # /bin is usr/bin
            assert [e["name"] for e in await a.list_dir(MARKERS)] == ["usr_bin_sync"]
            await a.remove(f"{MARKERS}/usr_bin_sync")
            # Machine.snapshot would still run the guest's `sync`: flush through the agent.
            await a.sync()
            snap = await origin.vm.snapshot(snap_dir)
        contents = tmp / "ro-contents"
        contents.mkdir()
        (contents / "hello.txt").write_bytes(b"from the host\n")
        rw, ro = tmp / "rw.img", tmp / "ro.img"
        make_volume(rw, 64)
        make_volume(ro, 32, contents)
        volumes = (Drive(rw, "vol-rw"), Drive(ro, "vol-ro", read_only=True))
        machine = await Machine.restore(runtime.driver, runtime.pool, snap, drives=volumes)
        async with machine:
            yield Guest(machine, rw, ro)
    finally:
        shutil.rmtree(snap_dir, ignore_errors=True)


async def no_markers(g: Guest) -> None:
    assert await g.machine.agent.list_dir(MARKERS) == []


async def test_sync_everything_and_per_file_system(guest: Guest) -> None:
    await guest.machine.agent.sync()
    await guest.machine.agent.sync(["/"])
    await no_markers(guest)


async def test_volumes_mount_in_a_restored_guest_that_saw_empty_slots(guest: Guest) -> None:
    a = guest.machine.agent
    sizes = {}
    for e in await a.list_dir("/sys/block"):
        if e["name"].startswith("vd"):
            serial = (await a.read_file(f"/sys/block/{e['name']}/serial")).strip()
            sizes[serial] = int(await a.read_file(f"/sys/block/{e['name']}/size"))
    assert sizes[b"vol-rw"] == sizes[b"vol-ro"] == 0  # what the guest saw at its snapshot
    mounted = await a.mount_volumes(
        [GuestVolume("vol-rw", "/mnt/rw"), GuestVolume("vol-ro", "/mnt/ro", read_only=True)]
    )
    assert [(m.serial, m.target, m.read_only) for m in mounted] == [
        ("vol-rw", "/mnt/rw", False),
        ("vol-ro", "/mnt/ro", True),
    ]
    assert all(m.device.startswith("/dev/vd") for m in mounted)
    assert await a.read_file("/mnt/ro/hello.txt") == b"from the host\n"
    await a.write_file("/mnt/rw/kept", b"written in the guest\n")
    with pytest.raises(AgentError, match="Read-only"):
        await a.write_file("/mnt/ro/nope", b"x")
    with pytest.raises(AgentError, match="not attached") as e:
        await a.mount_volumes([GuestVolume("vol-none", "/mnt/none")])
    assert e.value.code == "not_found"
    await no_markers(guest)


async def test_unmount_takes_off_a_tenant_mount_on_top_and_says_what_failed(
    guest: Guest,
) -> None:
    a = guest.machine.agent
    # The tenant bind-mounts something over the volume, and leaves a link for a target.
    assert (await a.run(["/root/tenant-mount", "--bind", "/tmp", "/mnt/rw"])).ok
    assert (await a.run(["ln", "-s", "/tmp", "/mnt/link"])).ok
    result = await a.unmount(["/mnt/rw", "/mnt/ro", "/mnt/link", "/mnt/none"])
    assert result.unmounted == ("/mnt/rw", "/mnt/ro")
    assert sorted(result.failed) == ["/mnt/link", "/mnt/none"]
    assert result.failed["/mnt/link"].code == "invalid"
    assert result.failed["/mnt/none"].code == "not_found"
    # Flushed and unmounted: the host reads the volume's file system, clean, from its image.
    image = str(guest.rw_image)
    kept = await asyncio.to_thread(host_run, "debugfs", "-R", "cat /kept", image)
    assert kept.stdout == b"written in the guest\n"
    fsck = await asyncio.to_thread(host_run, "e2fsck", "-n", "-f", image)
    assert fsck.returncode == 0, fsck.stdout
    await no_markers(guest)


async def test_root_fs_grows_online_to_the_grown_disk(guest: Guest) -> None:
    m = guest.machine
    new_size = m.disk.stat().st_size + (256 << 20)
    await m.vm.resize_disk(new_size)
    grown = await m.agent.grow_root_fs(min_size=new_size)
    assert grown.disk_bytes == new_size
    assert grown.fs_bytes - grown.fs_bytes_before > 240 << 20
    assert grown.fs_bytes <= new_size
    r = await m.agent.run(["stat", "-f", "-c", "%b %S", "/"])
    blocks, size = (int(x) for x in r.stdout.split())
    assert blocks * size == grown.fs_bytes
    again = await m.agent.grow_root_fs()  # nothing more to grow: the same size
    assert again.fs_bytes == grown.fs_bytes
    await no_markers(guest)


async def test_install_ca_past_the_tenants_traps(guest: Guest) -> None:
    a = guest.machine.agent
    await a.mkdir("/root/elsewhere")
    assert (await a.run(["ln", "-s", "/root/elsewhere", "/etc/space"])).ok
    with pytest.raises(AgentError, match="symbolic link") as e:
        await a.install_ca(PEM)
    assert e.value.code == "invalid" and await a.list_dir("/root/elsewhere") == []
    await a.remove("/etc/space")
    await a.write_file("/root/victim", b"untouched")
    await a.mkdir("/etc/space")
    assert (await a.run(["ln", "-s", "/root/victim", "/etc/space/ca-bundle.pem"])).ok
    installed = await a.install_ca(PEM)
    assert installed.system_bundle
    system = await a.read_file("/etc/ssl/certs/ca-certificates.crt")
    bundle = await a.read_file(installed.bundle_path)
    assert bundle.startswith(system) and bundle.endswith(PEM)
    assert len(bundle) == installed.bundle_size and await a.read_file(installed.ca_path) == PEM
    assert await a.read_file("/root/victim") == b"untouched"
    for path in (installed.ca_path, installed.bundle_path):
        st = await a.stat(path)
        assert (st["type"], st["mode"], st["uid"], st["gid"]) == ("file", 0o644, 0, 0)
    await no_markers(guest)


async def test_tcp_connect_reaches_a_guest_listener(guest: Guest) -> None:
    a = guest.machine.agent
    server = await a.exec([TENANT_PYTHON, "-c", ECHO])
    try:
        port = await _listening_port(a)
        data = os.urandom(2 << 20)
        async with await a.tcp_connect(port) as stream:

            async def send() -> None:
                await stream.write(data)
                await stream.close_write()

            _, back = await asyncio.gather(send(), _read_all(stream))
            closed = await stream.wait_closed()
        assert back == data + b"|" + hashlib.sha256(data).hexdigest().encode()
        assert (closed.sent, closed.received, closed.reset) == (len(data), len(back), False)
        with pytest.raises(AgentError) as e:
            await a.tcp_connect(port + 1 if port < 65535 else port - 1)
        assert e.value.code == "connection_refused"
    finally:
        server.drop()
        await a.run(["pkill", "-f", "tenant-python"])
    await no_markers(guest)


async def test_a_flood_of_output_is_cut_at_the_cap_and_memory_stays_bounded(
    guest: Guest,
) -> None:
    a = guest.machine.agent
    tracemalloc.start()
    try:
        r = await a.run(["yes", "flood"], timeout=60)  # the agent cuts it off
        # The client cuts it off too, whatever the agent does: here it was not told the cap.
        proc = await a.exec(["yes", "flood"], timeout=60)
        r2 = await proc.wait(max_output=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for result in (r, r2):
        assert result.truncated and len(result.stdout) == 1 << 20 and result.signal == 9
    assert peak < 12 << 20
    assert a.connected
    await no_markers(guest)


async def test_a_frozen_root_fs_holds_every_write_until_it_is_thawed(guest: Guest) -> None:
    """What a build does between two steps in one VM, while it copies the disk."""
    a = guest.machine.agent
    assert await a.thaw_root_fs() is False  # it was not frozen
    await a.write_file("/root/freed", os.urandom(8 << 20))
    await a.remove("/root/freed")
    trimmed = await a.freeze_root_fs()
    assert trimmed is not None and trimmed >= 8 << 20
    # A process's write (the agent's own file calls write on its event loop: none is made).
    writer = asyncio.ensure_future(a.run(["/usr/bin/dash", "-c", "echo held > /root/held"]))
    try:
        await asyncio.sleep(2)
        assert not writer.done(), await writer  # held by the freeze
    finally:
        assert await a.thaw_root_fs() is True
    result = await asyncio.wait_for(writer, 60)
    assert result.exit_code == 0 and await a.read_file("/root/held") == b"held\n"
    await no_markers(guest)


async def test_sealing_the_root_fs_trims_flushes_and_ends_writes(guest: Guest) -> None:
    """The last test here: the guest's root is read-only after it (as a finished build's)."""
    a = guest.machine.agent
    await a.write_file("/root/freed", os.urandom(8 << 20))
    await a.remove("/root/freed")
    sealed = await a.seal_root_fs()
    assert sealed.read_only
    assert sealed.trimmed_bytes is not None and sealed.trimmed_bytes >= 8 << 20
    with pytest.raises(AgentError, match="Read-only"):
        await a.write_file("/root/after", b"x")
    await no_markers(guest)


async def _listening_port(a: AgentClient) -> int:
    for _ in range(150):
        with contextlib.suppress(AgentError, ValueError):
            return int(await a.read_file("/tmp/echo.port"))
        await asyncio.sleep(0.2)
    raise AssertionError("the guest's echo server did not start")


async def _read_all(stream: TcpStream) -> bytes:
    return b"".join([chunk async for chunk in stream])

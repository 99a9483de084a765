"""What a VM's memory costs the host: guests give back what they free, and clones of a base
snapshot share its memory file without being able to change it."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

import pytest

from space.worker.local import LocalRuntime
from space.worker.machine import Machine, remap
from space.worker.vmm.base import SnapshotInfo, VMConfig, VMMError
from space.worker.vmm.qemu import QemuDriver

pytestmark = pytest.mark.vm

# A guest process that touches {mib} MiB, says so in /tmp/held and holds it.
HOLD = (
    "rm -f /tmp/held; python3 -c 'import time\nb = bytearray({mib} << 20)\n"
    'for i in range(0, len(b), 4096): b[i] = 1\nopen("/tmp/held", "w").close()\n'
    "time.sleep(600)' >/dev/null 2>&1 & echo $!"
)


GIVER_MIB = 384


async def hold(m: Machine, mib: int) -> int:
    """Start a process in `m` that holds `mib` MiB it touched; its pid once it holds them."""
    pid = int((await m.agent.run(HOLD.format(mib=mib))).stdout)
    for _ in range(300):
        if (await m.agent.run("test -e /tmp/held")).exit_code == 0:
            return pid
        if (await m.agent.run(f"kill -0 {pid}")).exit_code != 0:
            break  # it died before it held them: the guest's log says why
        await asyncio.sleep(0.1)
    log = await m.agent.run("free -m; dmesg | tail -n 40")
    raise AssertionError(f"the guest did not touch {mib} MiB within 30 s:\n"
                         f"{log.stdout.decode(errors='replace')}")  # fmt: skip


def guest_ram(pid: int, memory_mib: int) -> dict[str, int]:
    """The smaps figures (KiB) of the VMM's mapping of guest RAM: the one of its size."""
    size, figures = memory_mib << 10, {}
    found = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            found = (end - start) >> 10 == size
        elif found and head[0] in ("Rss:", "Pss:", "Shared_Clean:", "Private_Dirty:"):
            figures[head[0][:-1]] = int(head[1])
    assert figures, f"no mapping of {memory_mib} MiB in VMM {pid}"
    return figures


def vmm_pid(m: Machine) -> int:
    pid = m.status().pid
    assert pid is not None
    return pid


def test_guest_ram_in_a_file_never_gets_a_balloon(tmp_path: Path) -> None:
    """QEMU 7.2 would punch the freed pages out of the file: in a snapshot's memory file, out
    of every clone's memory. The command line refuses the pair, whoever asks for it."""
    config = VMConfig(vm_id="a", kernel=tmp_path / "k", rootfs=tmp_path / "r")
    anonymous = QemuDriver().argv(config.with_changes(free_page_reporting=True), tmp_path)
    assert "virtio-balloon-device,free-page-reporting=on" in anonymous
    mapped = config.with_changes(memory_file=tmp_path / "memory.bin")
    argv = QemuDriver().argv(mapped, tmp_path)
    assert not any("balloon" in arg for arg in argv)
    assert f"mem-path={tmp_path}/memory.bin,share=off" in " ".join(argv)
    with pytest.raises(VMMError, match="cannot have a reporting balloon"):
        QemuDriver().argv(mapped.with_changes(free_page_reporting=True), tmp_path)


async def test_a_guest_gives_back_the_memory_it_frees(runtime: LocalRuntime) -> None:
    # 384 MiB: a 256 MiB guest has ~218 MiB for itself, and its kernel sometimes kills a
    # process that holds 160 of them (out of memory).
    async with await Machine.boot(
        runtime.driver, runtime.pool, runtime.images, memory_mib=GIVER_MIB
    ) as m:
        assert m.vm.config.free_page_reporting
        held = await hold(m, 160)
        high = guest_ram(vmm_pid(m), GIVER_MIB)["Rss"]
        assert high > 160 << 10, f"the guest's 160 MiB do not show on the host ({high} KiB)"
        await m.agent.run(["kill", str(held)])
        # The guest reports freed blocks after a delay of 2 s; the host drops them at once.
        # Only whole free 2 MiB blocks are reported, and the guest's kernel keeps some of what
        # the process freed for its caches: most, not all, of the 160 MiB comes back.
        for _ in range(100):
            now = guest_ram(vmm_pid(m), GIVER_MIB)["Rss"]
            if now < high - (96 << 10):
                break
            await asyncio.sleep(0.2)
        assert now < high - (96 << 10), f"held {high} KiB, {now} KiB after the guest freed it"


def mapped_file(runtime: LocalRuntime, clone: Machine, memory: Path) -> Path:
    """The file a clone of a snapshot whose memory is `memory` maps: that one, or, for a jailed
    QEMU that opens it for writing (before 8.2), a reflink of its own."""
    return memory if runtime.driver.shares_snapshot_memory else clone.run_dir / "memory.bin"


async def test_clones_share_a_base_snapshots_memory_and_cannot_change_it(
    runtime: LocalRuntime,
) -> None:
    async with await Machine.boot(
        runtime.driver, runtime.pool, runtime.images, snapshot_source=True
    ) as origin:
        snap = await origin.snapshot(runtime.pool.snapshots / f"test-{origin.id}")
    memory = snap.path / snap.files["memory"]
    # The stream holds the devices only; the guest's memory is the file.
    assert (snap.path / snap.files["state"]).stat().st_size < 4 << 20
    digest = hashlib.sha256(memory.read_bytes()).hexdigest()
    clones: list[Machine] = []
    try:
        clones = [await Machine.restore(runtime.driver, runtime.pool, snap) for _ in range(2)]
        a, b = clones
        # No balloon: QEMU 7.2 would discard freed pages by punching holes in the shared file.
        assert not a.vm.config.free_page_reporting
        assert a.vm.config.memory_file == mapped_file(runtime, a, memory)
        if a.vm.config.memory_file == memory:
            shared = guest_ram(vmm_pid(b), 256)["Shared_Clean"]
            assert shared > 16 << 10, f"the clones share {shared} KiB of the snapshot's memory"
        # Clone A writes, frees and overwrites as much memory as it can.
        # /run is a tmpfs: the mark is in A's RAM.
        assert (await a.agent.run("echo a > /run/mark && test -e /run/mark")).exit_code == 0
        held = await hold(a, 150)
        await a.agent.run(["kill", str(held)])
        await a.agent.run("sync; echo 3 > /proc/sys/vm/drop_caches")
        await b.agent.write_file("/root/b", b"b's own")
        assert await b.agent.read_file("/root/b") == b"b's own"
        await asyncio.sleep(3)  # past any reporting delay
        assert hashlib.sha256(memory.read_bytes()).hexdigest() == digest
        # A's writes are its own: B and a third clone made now do not see them.
        clones.append(await Machine.restore(runtime.driver, runtime.pool, snap))
        for other in clones[1:]:
            assert (await other.agent.run("test -e /run/mark")).exit_code == 1
        # A mapped clone is snapshotted (suspended) as a stream, and comes back with its state.
        pid = int((await a.agent.run("sleep 600 >/dev/null 2>&1 & echo $!")).stdout)
        await a.agent.write_file("/root/a", b"a's own")
        suspended = await a.snapshot(runtime.pool.snapshots / f"test-{a.id}")
        try:
            assert "memory" not in suspended.files
            await a.close()
            loaded = SnapshotInfo.load(suspended.path)
            async with await Machine.restore(
                runtime.driver, runtime.pool, loaded, vm_id=loaded.config.vm_id
            ) as back:
                assert back.vm.config.memory_file is None
                assert (await back.agent.run(["kill", "-0", str(pid)])).exit_code == 0
                assert await back.agent.read_file("/root/a") == b"a's own"
        finally:
            shutil.rmtree(suspended.path)
    finally:
        for m in clones:
            await m.close()
        shutil.rmtree(snap.path)


async def test_a_stream_saved_again_by_remap_is_a_mapped_snapshot(runtime: LocalRuntime) -> None:
    """How a checkpoint (a stream) becomes a template's base snapshot or a fork's source: its
    state loaded once into a VM whose RAM is a file, and saved at once; clones map that file."""
    made: list[Path] = []

    async def snapshot(m: Machine) -> SnapshotInfo:
        snap = await m.snapshot(runtime.pool.snapshots / f"test-{m.id}")
        made.append(snap.path)
        return snap

    async def remapped(snap: SnapshotInfo) -> SnapshotInfo:
        dest = runtime.pool.snapshots / f"test-remap-{snap.path.name}"
        made.append(dest)
        return await remap(runtime.driver, snap, dest, vm_id=f"remap-{snap.config.vm_id}",
                           vms_dir=runtime.pool.vms)  # fmt: skip

    try:
        async with await Machine.boot(
            runtime.driver, runtime.pool, runtime.images, snapshot_source=True
        ) as origin:
            base = await snapshot(origin)
        async with await Machine.restore(runtime.driver, runtime.pool, base) as sandbox:
            await sandbox.agent.run("echo kept > /run/mark")
            pid = int((await sandbox.agent.run("sleep 600 >/dev/null 2>&1 & echo $!")).stdout)
            checkpoint = await snapshot(sandbox)
        assert "memory" not in checkpoint.files
        template = await remapped(checkpoint)
        assert "memory" in template.files
        assert (template.path / template.files["state"]).stat().st_size < 4 << 20
        assert template.config.agent_token == checkpoint.config.agent_token  # it never ran
        assert not list(runtime.pool.vms.glob("remap-*"))  # its VM is gone
        async with await Machine.restore(runtime.driver, runtime.pool, template) as clone:
            memory = template.path / template.files["memory"]
            assert clone.vm.config.memory_file == mapped_file(runtime, clone, memory)
            assert (await clone.agent.run("cat /run/mark")).stdout == b"kept\n"
            assert (await clone.agent.run(["kill", "-0", str(pid)])).exit_code == 0

        # A stream of a VM with a balloon cannot have its RAM in a file: it stays a stream.
        async with await Machine.boot(runtime.driver, runtime.pool, runtime.images) as cold:
            ballooned = await snapshot(cold)
        assert "memory" not in (await remapped(ballooned)).files
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)

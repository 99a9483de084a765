"""A `Machine` is one VM as the worker holds it: its own disk, its VMM, its agent connection.

It is the one owner of those three: `boot()` and `restore()` make them, `close()` releases all
of them (VMM process, sockets, disk, run directory) whatever state the VM is in, including
after the VMM died on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from space.worker.agent_client import AgentClient, AgentConnectionLost, AgentError
from space.worker.storage.pool import Pool
from space.worker.storage.reflink import clone_file
from space.worker.vmm.base import (
    MEMORY_FILE,
    VM,
    Drive,
    Driver,
    SnapshotInfo,
    VMConfig,
    VMGone,
    VMState,
    VMStatus,
)

log = logging.getLogger(__name__)

DISK = "disk.img"
ANSWER_S = 3.0  # for a VMM to answer before a snapshot is taken of it
SNAPSHOT_SYNC_S = 10.0


@dataclass(frozen=True)
class BootImages:
    """What a VM boots: the guest kernel, its initramfs and a template root image."""

    kernel: Path
    initrd: Path | None
    rootfs: Path


def new_vm_id() -> str:
    return uuid.uuid4().hex[:12]


def new_token() -> str:
    return secrets.token_urlsafe(32)


class Machine:
    def __init__(self, vm: VM, agent: AgentClient, timings: dict[str, float]) -> None:
        self.vm = vm
        self.agent = agent
        self.timings = timings  # seconds per phase of how it came up (they add up to the whole)
        # Set by the worker's watch over its VMs: QEMU stopped the guest on an I/O error (a
        # full pool), or the VMM did not answer in time.
        self.io_error: str | None = None
        self.unresponsive = False

    @property
    def id(self) -> str:
        return self.vm.id

    @property
    def run_dir(self) -> Path:
        return self.vm.run_dir

    @property
    def disk(self) -> Path:
        return self.vm.config.rootfs

    @classmethod
    async def boot(
        cls,
        driver: Driver,
        pool: Pool,
        images: BootImages,
        *,
        vm_id: str | None = None,
        vcpus: int = 1,
        memory_mib: int = 256,
        hostname: str | None = None,
        boot_timeout: float = 90.0,
        vms_dir: Path | None = None,
        drives: tuple[Drive, ...] = (),
        tap_fd: int | None = None,
        guest_mac: str | None = None,
        snapshot_source: bool = False,
    ) -> Machine:
        """Cold boot: clone the template, start the VMM, wait for the agent to answer.

        The run directory is `vms_dir / vm_id` (`vms_dir` defaults to the pool's `vms`). A
        `snapshot_source` is booted to be snapshotted and restored many times (a base
        snapshot): its RAM is a file where the driver can map one.
        """
        t0 = time.perf_counter()
        vm_id = vm_id or new_vm_id()
        run_dir = _make_run_dir(vms_dir or pool.vms, vm_id)
        try:
            disk = run_dir / DISK
            await asyncio.to_thread(clone_file, images.rootfs, disk)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        try:
            return await cls._boot_on(
                driver, images, run_dir, vm_id=vm_id, vcpus=vcpus, memory_mib=memory_mib,
                hostname=hostname, boot_timeout=boot_timeout, drives=drives, tap_fd=tap_fd,
                guest_mac=guest_mac, t0=t0,
                memory_file=run_dir / MEMORY_FILE if snapshot_source else None,
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise

    @classmethod
    async def reboot(
        cls,
        driver: Driver,
        images: BootImages,
        run_dir: Path,
        *,
        vm_id: str,
        vcpus: int,
        memory_mib: int,
        hostname: str,
        drives: tuple[Drive, ...],
        tap_fd: int | None,
        guest_mac: str | None,
        keep: Iterable[str] = (),
        boot_timeout: float = 90.0,
    ) -> Machine:
        """Boot a VM again on the disk its VMM left in `run_dir` (the VMM died): files are
        kept, processes are not. The run directory and its disk stay whatever happens; of the
        other files in it, those named in `keep` stay too."""
        kept = {DISK, *keep}
        for leftover in run_dir.iterdir():
            if leftover.name not in kept and leftover.is_file():
                leftover.unlink(missing_ok=True)  # sockets, logs, vm.json of the dead VMM
        return await cls._boot_on(
            driver, images, run_dir, vm_id=vm_id, vcpus=vcpus, memory_mib=memory_mib,
            hostname=hostname, boot_timeout=boot_timeout, drives=drives, tap_fd=tap_fd,
            guest_mac=guest_mac, t0=time.perf_counter(), keep_on_failure=True,
        )  # fmt: skip

    @classmethod
    async def _boot_on(
        cls,
        driver: Driver,
        images: BootImages,
        run_dir: Path,
        *,
        vm_id: str,
        vcpus: int,
        memory_mib: int,
        hostname: str | None,
        boot_timeout: float,
        drives: tuple[Drive, ...],
        tap_fd: int | None,
        guest_mac: str | None,
        t0: float,
        keep_on_failure: bool = False,
        memory_file: Path | None = None,
    ) -> Machine:
        config = VMConfig(
            vm_id=vm_id,
            kernel=images.kernel,
            initrd=images.initrd,
            rootfs=run_dir / DISK,
            vcpus=vcpus,
            memory_mib=memory_mib,
            hostname=hostname or f"sb-{vm_id}",
            agent_token=new_token(),
            drives=drives,
            tap_fd=tap_fd,
            nic=tap_fd is not None,
            guest_mac=guest_mac,
            memory_file=memory_file,
            memory_shared=memory_file is not None,
        )
        t1 = time.perf_counter()
        vm = await driver.boot(config, run_dir)
        t2 = time.perf_counter()
        agent = await _connect_agent(vm, config.agent_token, boot_timeout, keep_on_failure)
        machine = cls(vm, agent, {"disk": t1 - t0, "vmm": t2 - t1})
        # The boot token sits in /proc/cmdline for every guest process to read; replace it
        # before any of them runs.
        await machine._first_identity(None, keep_on_failure)
        machine.timings["agent"] = time.perf_counter() - t2
        return machine

    @classmethod
    async def restore(
        cls,
        driver: Driver,
        pool: Pool,
        snapshot: SnapshotInfo,
        *,
        vm_id: str | None = None,
        hostname: str | None = None,
        timeout: float = 30.0,
        vms_dir: Path | None = None,
        drives: tuple[Drive, ...] | None = None,
        tap_fd: int | None = None,
        before_start: Callable[[Path], Awaitable[None]] | None = None,
    ) -> Machine:
        """Start a VM from a snapshot and give it an identity of its own.

        Restoring with the snapshot's own id and hostname wakes that VM up again (a suspended
        sandbox); other ids make clones. `drives` puts other files in the snapshot's extra
        drives (as many as it has); the guest sees them once it probes those devices again.
        `before_start(run_dir)` runs once the state is loaded and before the guest runs: a
        caller retires the snapshot there, so that a running guest and a snapshot it has
        outgrown never both look current.
        """
        t0 = time.perf_counter()
        vm_id = vm_id or new_vm_id()
        run_dir = _make_run_dir(vms_dir or pool.vms, vm_id)
        vm, disk_s = await _load(driver, snapshot, run_dir, paused=before_start is not None,
                                 drives=drives, vm_id=vm_id, tap_fd=tap_fd)  # fmt: skip
        if before_start is not None:
            try:
                await before_start(run_dir)
                await vm.resume()
            except BaseException:
                await _discard(vm)
                raise
        t2 = time.perf_counter()
        # The snapshot's token opens the first connection; a fresh one replaces it at once, so
        # no two restores of one snapshot share a token, a hostname or an RNG state.
        agent = await _connect_agent(vm, snapshot.config.agent_token, timeout)
        t3 = time.perf_counter()
        machine = cls(vm, agent, {"disk": disk_s, "vmm": t2 - t0 - disk_s, "hello": t3 - t2})
        await machine._first_identity(hostname or f"sb-{vm_id}")
        machine.timings["identity"] = time.perf_counter() - t3
        return machine

    async def _first_identity(self, hostname: str | None, keep_disk: bool = False) -> None:
        try:
            await self.renew_identity(hostname)
        except BaseException:
            await self.agent.close()
            await _discard(self.vm, keep_disk)
            raise

    async def renew_identity(self, hostname: str | None = None) -> None:
        """Our clock, a reseeded RNG and a new agent token (and hostname) for the guest.

        After a boot the old token was on the kernel command line; after a restore it is the
        snapshot's, shared by every clone; a warm-pool VM gets one more at its claim."""
        token = new_token()
        await self.agent.refresh_identity(hostname=hostname, token=token)
        changes: dict[str, str] = {"agent_token": token}
        if hostname is not None:
            changes["hostname"] = hostname
        self.vm.config = self.vm.config.with_changes(**changes)
        self.vm.save()

    async def reconnect(self, timeout: float = 30.0) -> None:
        """A new agent connection (after the old one was lost, e.g. across a snapshot)."""
        await self.agent.close()
        self.agent = await _connect_agent(self.vm, self.vm.config.agent_token, timeout)

    async def grow_disk(self, size_mib: int) -> None:
        """Make the root disk (and its ext4 file system) `size_mib` large; never shrinks it.

        The file system's size is the sandbox's disk quota: past it, writes fail with ENOSPC
        inside the guest, and nothing outside it fills up."""
        size = size_mib << 20
        current = self.disk.stat().st_size
        if size < current:
            raise ValueError(f"the disk is already {current >> 20} MiB; it cannot shrink")
        if size == current:
            return
        await self.vm.resize_disk(size)
        try:
            await self.agent.grow_root_fs(min_size=size)
        except AgentError as e:
            raise ValueError(f"growing the root file system failed: {e}") from None

    def status(self) -> VMStatus:
        return self.vm.status()

    async def pause(self) -> None:
        await self.vm.pause()

    async def resume(self) -> None:
        await self.vm.resume()

    async def snapshot(self, dest: Path) -> SnapshotInfo:
        """Flush the guest's file system, then save memory, devices and disk. Leaves it paused.

        A paused guest cannot run `sync`, and needs none: its unwritten pages are in the memory
        image, and the disk is saved as it was at the moment it paused.
        """
        await self.quiesce()
        return await self.vm.snapshot(dest)

    async def quiesce(self) -> None:
        """Before a snapshot: a VMM that does not answer fails it at once, with the reason,
        before anything is stopped or written (the VM stays as it was); a running guest's file
        systems are flushed by its agent, within a short deadline: a guest that hangs must not
        hold the snapshot (and the sandbox's lock), and its unwritten pages are in the memory
        image either way."""
        await self.vm.answering(ANSWER_S)
        running = self.status().state == VMState.RUNNING and self.io_error is None
        if self.agent.connected and running:
            try:
                await self.agent.sync(deadline=SNAPSHOT_SYNC_S)
            except AgentError as e:
                log.warning("VM %s: no sync before its snapshot (%s); taken all the same",
                            self.id, e)  # fmt: skip

    async def detach(self) -> None:
        """Let go of the VM but leave it running, for a later worker process to adopt."""
        await self.agent.close()
        await self.vm.detach()

    async def close(self) -> None:
        """Release everything: agent connection, VMM process, sockets, disk, run directory."""
        await self.agent.close()
        await _discard(self.vm)

    async def __aenter__(self) -> Machine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def remap(
    driver: Driver,
    snapshot: SnapshotInfo,
    dest: Path,
    *,
    vm_id: str,
    vms_dir: Path,
    drives: tuple[Drive, ...] | None = None,
    tap_fd: int | None = None,
) -> SnapshotInfo:
    """`snapshot` saved again into `dest` with its memory as a file that restores map, where
    the driver keeps RAM in files: its state is loaded once into a VM whose RAM is such a file
    and saved at once, the guest never running. Restores of a stream each copy all of it;
    restores of the new snapshot read pages as they touch them and share those none wrote."""
    run_dir = _make_run_dir(vms_dir, vm_id)
    vm, _ = await _load(
        driver, snapshot, run_dir, paused=True, drives=drives, vm_id=vm_id, tap_fd=tap_fd,
        memory_file=run_dir / MEMORY_FILE, memory_shared=True,
    )  # fmt: skip
    try:
        return await vm.snapshot(dest)
    finally:
        await _discard(vm)


async def _load(
    driver: Driver, snapshot: SnapshotInfo, run_dir: Path, *, paused: bool,
    drives: tuple[Drive, ...] | None, **changes: Any,
) -> tuple[VM, float]:  # fmt: skip
    """The snapshot's VM started in `run_dir` on a clone of its disk, `changes` made to its
    config (`drives` other files in its extra drives); how long the disk took. The run
    directory is removed if it fails."""
    try:
        started = time.perf_counter()
        disk = run_dir / DISK
        await asyncio.to_thread(clone_file, snapshot.path / snapshot.files["disk"], disk)
        config = snapshot.config.with_changes(rootfs=disk, **changes)
        if drives is not None:
            config = config.with_changes(drives=drives)
        disk_s = time.perf_counter() - started
        return await driver.restore(snapshot, config, run_dir, paused=paused), disk_s
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _make_run_dir(vms_dir: Path, vm_id: str) -> Path:
    run_dir = vms_dir / vm_id
    try:
        run_dir.mkdir(mode=0o700)
    except FileExistsError:
        raise ValueError(f"a VM with id {vm_id!r} already exists on this worker") from None
    return run_dir


async def _connect_agent(
    vm: VM, token: str, timeout: float, keep_disk: bool = False
) -> AgentClient:
    try:
        return await _wait_agent(vm, token, timeout)
    except BaseException:
        await _discard(vm, keep_disk)
        raise


async def _wait_agent(vm: VM, token: str, timeout: float) -> AgentClient:
    """Connect and authenticate; if the VMM dies meanwhile, say so instead of timing out."""
    connect = asyncio.ensure_future(AgentClient.connect(vm.open_agent_stream, token, timeout))
    died = asyncio.ensure_future(vm.wait())
    try:
        await asyncio.wait([connect, died], return_when=asyncio.FIRST_COMPLETED)
    finally:
        died.cancel()
    if connect.done():
        return connect.result()
    connect.cancel()
    with contextlib.suppress(BaseException):
        await connect
    status = vm.status()
    tail = vm.console_text()[-2000:]
    raise VMGone(f"VM {vm.id} died before its agent answered: {status.reason}\n{tail}")


async def _discard(vm: VM, keep_disk: bool = False) -> None:
    """End the VMM and remove its run directory; with `keep_disk`, only the VMM's own files."""
    with contextlib.suppress(AgentConnectionLost):
        await vm.close()
    if keep_disk:
        return  # the VM's close removed its sockets and logs; the disk is the sandbox's
    shutil.rmtree(vm.run_dir, ignore_errors=True)

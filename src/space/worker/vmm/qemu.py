"""The QEMU `-M microvm` driver: KVM where a probe boot proved it works, TCG otherwise.

The VM is controlled over QMP (pause, resume, migrate-to-file for snapshots, quit); the guest
agent is a virtio-serial port backed by a unix socket; the serial console goes to a file.
A snapshot is QEMU's migration stream written to a file while the VM is paused, plus a
copy-on-write clone of the disk as it was at that moment; a restore starts a fresh QEMU with the
same machine and `-incoming` from that file.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from qemu.qmp import QMPClient

from space.guest.protocol import AGENT_PORT_NAME
from space.settings import Shares
from space.worker import formats
from space.worker.network.manager import open_tap_device, tap_namespace
from space.worker.storage.reflink import clone_file
from space.worker.vmm.base import (
    MEMORY_FILE,
    SNAPSHOT_DISK,
    VM,
    Driver,
    SnapshotInfo,
    VMConfig,
    VMGone,
    VMMError,
    VMMUnresponsive,
    VMState,
    VMStateError,
    VMStatus,
)
from space.worker.vmm.jail import Confinement, Jail
from space.worker.vmm.process import VMMProcess

log = logging.getLogger(__name__)

STATE_FILE = "state.bin"
# The id QEMU gives microvm's RAM by itself: a backend of ours under it keeps migration streams
# of mapped and anonymous VMs interchangeable.
RAM_ID = "microvm.ram"
IGNORE_SHARED = "x-ignore-shared"
QMP_SOCKET = "qmp.sock"
AGENT_SOCKET = "agent.sock"
CONSOLE_LOG = "console.log"
QEMU_LOG = "qemu.log"
VM_FILE = "vm.json"
DRIVE_ID = "drive"  # extra drives are drive0, drive1, …
# Descriptors the VMM inherits: everything it reads or writes but its kernel, initramfs and a
# memory file (which QEMU opens by path, inside its jail).
STATE_FD = 3
TAP_FD = 4
QMP_FD = 5
AGENT_FD = 6
AGENT_CHARDEV = "agent"
CONSOLE_FD = 7
CONSOLE_TAIL_LINES = 25
TAIL_BYTES = 16 << 10  # of a log read for its last lines: a guest can fill its console
DISK_FD = 8
DRIVE_FD = 9  # extra drive i: DRIVE_FD + i
# QEMU opens a disk read-only first, then for writing; a set holds a descriptor for each, the
# read-only one at this offset.
READ_FD_OFFSET = 32
# QEMU's image locks are open-file-description locks: on descriptors it dups from a set, they
# outlive its own copies and then lock it out of its image. One writer per disk or volume is
# the worker's rule (`sandboxes/volumes.py`), not the lock's.
DRIVE_OPTIONS = "format=raw,if=none,file.locking=off"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# QEMU maps a file privately from a read-only descriptor from 8.2 on (memory-backend-file's
# readonly=on with rom=off); before, it opens the file for writing whatever the mapping.
READONLY_PRIVATE_MAP = (8, 2)
SOCKET_WAIT_S = 10.0
STARTING_PER_CPU = 2  # VMMs starting at once, until they answer on QMP
QMP_TIMEOUT_S = 10.0
SNAPSHOT_TIMEOUT_S = 120.0
# QEMU's monitor answers only between chunks of an incoming state it loads: a large state,
# several at once on a busy host, keeps it silent for longer than QMP_TIMEOUT_S.
LOAD_TIMEOUT_S = 60.0
CONFIG_FILE = "qemu.cfg"  # the kernel command line: it holds the agent's boot token
MIGRATE_BANDWIDTH = 8 << 30  # bytes/s; QEMU's default (32 MiB/s) would make snapshots crawl
LIVE_DOWNTIME_MS = 50  # the longest stop a live snapshot aims for at its end
LIVE_PRECOPY_S = 20.0  # then a guest that keeps dirtying memory is paused for the rest


class QemuVM(VM):
    def __init__(
        self,
        config: VMConfig,
        run_dir: Path,
        process: VMMProcess,
        accel: str,
        jail: Jail | None = None,
        confinement: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.accel = accel
        self._proc = process
        self._jail = jail
        self.confinement = confinement  # the jail's uid and cgroup, given back when it is gone
        self._qmp: QMPClient | None = None
        self._state = VMState.STARTING
        self._reason: str | None = None
        self._ending = False  # stop/kill asked for: the exit is not a crash
        self._exited = asyncio.Event()
        self._fd_lock = asyncio.Lock()
        # A restore's agent stream, opened before the guest ran again (see `_connect_paused`).
        self._held_stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._watcher = asyncio.ensure_future(self._watch())

    # --- process lifetime ---------------------------------------------------------------------

    async def _watch(self) -> None:
        code = await self._proc.wait()
        if not self._ending:
            self._state = VMState.CRASHED
            if code is None:
                how = "exited"  # adopted: not our child, so its status is not ours to read
            elif code < 0:
                how = f"killed by signal {-code}"
            else:
                how = f"exited with code {code}"
            detail = _tail(self.run_dir / QEMU_LOG, 3)
            self._reason = f"VMM process {how}" + (f": {detail}" if detail else "")
            # The guest's last words (a panic, a reset) say why its VMM ended.
            log.warning("vm %s: %s; its console ended: %s", self.id, self._reason,
                        _tail(self.console_log, CONSOLE_TAIL_LINES))  # fmt: skip
        elif self._state != VMState.CRASHED:
            self._state = VMState.STOPPED
        self._exited.set()
        await self._release()

    async def _release(self) -> None:
        """Remove everything this VM made; never the caller's disk."""
        self._drop_held_stream()
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        for name in (QMP_SOCKET, AGENT_SOCKET, VM_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()
        if self._jail is not None and self.confinement is not None:
            await asyncio.to_thread(self._jail.release, self.confinement)
            self.confinement = None

    def _check_alive(self) -> None:
        if self._exited.is_set() or not self._proc.alive:
            raise VMGone(self._reason or f"VM {self.id} is no longer running")

    async def connect_qmp(self) -> None:
        """Connect to the VMM's monitor and wait for its greeting (the socket may be ours,
        listening before QEMU runs, or QEMU's own in VMs an earlier version started)."""
        sock = self.run_dir / QMP_SOCKET
        deadline = time.monotonic() + SOCKET_WAIT_S
        while True:
            if sock.exists():
                qmp = QMPClient(f"vm-{self.id}")
                connect = asyncio.ensure_future(qmp.connect(str(sock)))
                exited = asyncio.ensure_future(self._exited.wait())
                left = max(0.0, deadline - time.monotonic())
                await asyncio.wait({connect, exited}, timeout=left,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                exited.cancel()
                if connect.done() and connect.exception() is None:
                    self._qmp = qmp
                    return
                connect.cancel()
                await asyncio.wait({connect})  # its end, never swallowing our own cancellation
                with contextlib.suppress(Exception):
                    await qmp.disconnect()
            self._check_alive()
            if time.monotonic() > deadline:
                raise VMMError(f"QEMU did not answer on its QMP socket within {SOCKET_WAIT_S}s")
            await asyncio.sleep(0.005)

    async def _execute(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float = QMP_TIMEOUT_S
    ) -> Any:
        """One QMP command; a VMM that does not answer within `timeout` (frozen, stopped by a
        signal) raises TimeoutError rather than holding the caller."""
        self._check_alive()
        if self._qmp is None:
            raise VMMError(f"VM {self.id}: no QMP connection")
        try:
            return await asyncio.wait_for(self._qmp.execute(cmd, args), timeout)
        except TimeoutError:
            raise VMMUnresponsive(f"its VMM did not answer {cmd} within {timeout:.0f} s") from None
        except Exception as e:
            self._check_alive()
            raise VMMError(f"QMP {cmd} failed: {e}") from e

    async def _send_fd(self, name: str, path: Path) -> None:
        """Open `path` for writing and hand QEMU the descriptor as `name` (QMP `getfd`)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if self._qmp is None:
                raise VMMError(f"VM {self.id}: no QMP connection")
            async with self._fd_lock:  # QEMU pairs a descriptor with the next getfd
                self._qmp.send_fd_scm(fd)
                await self._execute("getfd", {"fdname": name})
        finally:
            os.close(fd)

    async def answering(self, timeout: float) -> None:
        await self.query_status(timeout)

    async def query_status(self, timeout: float = QMP_TIMEOUT_S) -> str:
        """QEMU's run state: running, paused, io-error (stopped on a write error), …"""
        result = await self._execute("query-status", timeout=timeout)
        return str(result["status"])

    # --- the VM interface ---------------------------------------------------------------------

    def status(self) -> VMStatus:
        return VMStatus(
            state=self._state,
            pid=self._proc.pid if not self._exited.is_set() else None,
            reason=self._reason,
            exit_code=self._proc.returncode,
        )

    def mark_running(self) -> None:
        if self._state == VMState.STARTING:
            self._state = VMState.RUNNING
        self.save()

    def save(self) -> None:
        """Record what a restarted worker needs to adopt this VM."""
        record: dict[str, Any] = {
            "driver": "qemu",
            "pid": self._proc.pid,
            "accel": self.accel,
            "config": self.config.to_json(),
        }
        if self.confinement is not None:
            record["jail"] = self.confinement
        tmp = self.run_dir / (VM_FILE + ".tmp")
        tmp.write_text(json.dumps(formats.stamp("vm", record)))
        tmp.chmod(0o600)  # holds the agent token
        tmp.replace(self.run_dir / VM_FILE)

    async def pause(self) -> None:
        if self._state == VMState.PAUSED:
            return
        if self._state not in (VMState.RUNNING, VMState.STARTING):
            raise VMStateError(f"cannot pause a VM that is {self._state}")
        await self._execute("stop")
        self._state = VMState.PAUSED

    async def resume(self) -> None:
        if self._state in (VMState.RUNNING, VMState.STARTING):
            return
        if self._state != VMState.PAUSED:
            raise VMStateError(f"cannot resume a VM that is {self._state}")
        await self._execute("cont")
        self._state = VMState.RUNNING

    async def continue_after_io_error(self) -> None:
        # QEMU stopped the vCPUs itself (werror=enospc); our own state still says running.
        await self._execute("cont")

    async def resize_disk(self, size_bytes: int) -> None:
        await self._execute("block_resize", {"device": "root", "size": size_bytes})

    async def snapshot(self, dest: Path) -> SnapshotInfo:
        return await self._save(dest, live=False)

    async def snapshot_live(self, dest: Path) -> SnapshotInfo:
        return await self._save(dest, live=True)

    async def _save(self, dest: Path, live: bool) -> SnapshotInfo:
        """QEMU's migration stream into a file, then a clone of the disk. Live, the guest runs
        while its memory is copied (QEMU stops it for the pages it dirtied last, within
        LIVE_DOWNTIME_MS); a guest that dirties memory faster than it is copied is slowed down,
        and paused after LIVE_PRECOPY_S for the rest to be copied then."""
        started = time.perf_counter()
        if not live:
            await self.pause()
        dest.mkdir(parents=True, exist_ok=True)
        state = dest / STATE_FILE
        params: dict[str, Any] = {"max-bandwidth": MIGRATE_BANDWIDTH}
        if live:
            params["downtime-limit"] = LIVE_DOWNTIME_MS
        await self._execute("migrate-set-parameters", params)
        # Live, QEMU slows a guest whose memory changes faster than it is copied (rather than
        # the pause after LIVE_PRECOPY_S copying all of it while the guest stands still).
        # A mapped VM's RAM is its file: the stream leaves it out and the file is cloned.
        mapped = self.config.memory_file is not None and self.config.memory_shared
        capabilities = _capabilities(**{"auto-converge": live, IGNORE_SHARED: mapped})
        await self._execute("migrate-set-capabilities", capabilities)
        # QEMU writes the stream to a descriptor we give it: it may open no file, run no program.
        await self._send_fd("snapshot", state)
        await self._execute("migrate", {"uri": "fd:snapshot"})
        deadline = time.monotonic() + SNAPSHOT_TIMEOUT_S
        force_at = time.monotonic() + LIVE_PRECOPY_S
        stopped_at = None if live else started  # when the guest stopped, if we stopped it
        while True:
            if time.monotonic() > deadline:
                with contextlib.suppress(VMMError, TimeoutError):
                    await self._execute("migrate_cancel")
                raise VMMError(f"snapshot of {self.id} took over {SNAPSHOT_TIMEOUT_S:.0f} s")
            progress = await self._execute("query-migrate")
            status = progress.get("status")
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                why = progress.get("error-desc", status)
                raise VMMError(f"snapshot of {self.id} failed: {why}")
            if stopped_at is None and time.monotonic() > force_at:
                stopped_at = time.perf_counter()
                await self.pause()
            await asyncio.sleep(0.005)
        done_at = time.perf_counter()
        # A completed migration leaves the guest stopped, live or not.
        self._state = VMState.PAUSED
        # Paused and migrated, the disk is quiescent: every completed write is in the host's page
        # cache, which the clone reads through.
        await asyncio.to_thread(clone_file, self.config.rootfs, dest / SNAPSHOT_DISK)
        files = {"state": STATE_FILE, "disk": SNAPSHOT_DISK}
        if mapped:
            assert self.config.memory_file is not None
            await asyncio.to_thread(clone_file, self.config.memory_file, dest / MEMORY_FILE)
            files["memory"] = MEMORY_FILE
        now = time.perf_counter()
        if stopped_at is not None:
            downtime = now - stopped_at
        else:  # QEMU's own figure for its stop, then what came after it here
            downtime = float(progress.get("downtime", 0)) / 1000 + (now - done_at)
        info = SnapshotInfo(
            path=dest,
            driver="qemu",
            # How the VM's RAM was backed is not the snapshot's: a restore maps `files`.
            config=self.config.with_changes(memory_file=None, memory_shared=False),
            files=files,
            took_s=now - started,
            downtime_s=downtime,
        )
        info.save()
        return info

    async def stop(self, timeout: float = 5.0) -> VMStatus:
        if self._exited.is_set():
            return self.status()
        self._ending = True
        with contextlib.suppress(VMMError):
            await self._execute("quit")
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except TimeoutError:
            return await self.kill()
        await self._watcher
        return self.status()

    async def kill(self) -> VMStatus:
        if not self._exited.is_set():
            self._ending = True
            self._proc.kill()
            await self._exited.wait()
        await self._watcher
        return self.status()

    async def wait(self) -> VMStatus:
        await self._exited.wait()
        await self._watcher
        return self.status()

    async def open_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self._check_alive()
        if self._held_stream is not None:
            held, self._held_stream = self._held_stream, None
            return held
        return await asyncio.open_unix_connection(str(self.run_dir / AGENT_SOCKET), limit=1 << 22)

    async def _connect_paused(self) -> None:
        """Open the agent's stream while the restored guest is still stopped.

        The snapshot recorded the host as connected to the agent's port. Were it not connected
        once the guest runs, QEMU would tell the guest it left, then that it came back; those
        notices travel beside the port's data, so the guest could see the host leave after it
        had already read our hello, and drop the authenticated connection we go on using."""
        if self._held_stream is not None:
            return
        self._held_stream = await self.open_agent_stream()
        deadline, pause = time.monotonic() + QMP_TIMEOUT_S, 0.001
        while time.monotonic() < deadline:  # until QEMU has taken the connection
            if await self.agent_connected():
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)  # a busy host's QEMU is not asked a hundred times
        raise VMMUnresponsive(
            f"its VMM did not take the agent's connection within {QMP_TIMEOUT_S:.0f} s"
        )

    async def agent_connected(self) -> bool:
        """Whether QEMU holds a host connection to the agent's port."""
        chardevs = await self._execute("query-chardev")
        return any(c["label"] == AGENT_CHARDEV and not c["filename"].startswith("disconnected:")
                   for c in chardevs)  # fmt: skip

    def _drop_held_stream(self) -> None:
        if self._held_stream is not None:
            self._held_stream[1].close()
            self._held_stream = None

    @property
    def console_log(self) -> Path:
        return self.run_dir / CONSOLE_LOG

    async def detach(self) -> None:
        """Let go of the VM without stopping it (another process will adopt it)."""
        self._ending = True
        self._watcher.cancel()
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None

    async def close(self) -> None:
        await super().close()
        await self._watcher
        for name in (CONSOLE_LOG, QEMU_LOG):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()


class QemuDriver(Driver):
    name = "qemu"

    def __init__(
        self,
        binary: str = "qemu-system-x86_64",
        accel: str = "tcg",
        guest_aslr: bool = False,
        free_page_reporting: bool = True,
        mapped_memory: bool = True,
        jail: Jail | None = None,
        shares: Shares | None = None,
    ) -> None:
        if accel not in ("tcg", "kvm"):
            raise ValueError(f"accel must be 'tcg' or 'kvm', not {accel!r}")
        self.binary = binary
        self.accel = accel
        self.guest_aslr = guest_aslr
        self.free_page_reporting = free_page_reporting
        self.mapped_memory = mapped_memory
        self.jail = jail
        self.shares = shares
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def _starting(self) -> asyncio.Semaphore:
        """The slots of VMMs starting at once (in this event loop)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:
            self._slots = (loop, asyncio.Semaphore(STARTING_PER_CPU * (os.cpu_count() or 1)))
        return self._slots[1]

    def _cmdline(self, config: VMConfig) -> str:
        cmdline = config.kernel_cmdline("ttyS0")
        if self.accel == "tcg":
            # Under TCG on a busy host the guest's TSC calibration against the PIT fails now and
            # then and the boot stalls with its clock stuck at 0; the emulated TSC runs at the
            # host's rate, so tell the guest that rate instead of letting it measure.
            khz = host_tsc_khz()
            if khz:
                cmdline += f" tsc_early_khz={khz} tsc=reliable"
            # TCG caches translated code by virtual address, so with address-space layout
            # randomisation every exec translates ld.so and libc afresh: 21 ms per exec of
            # /usr/bin/true against 8 ms without. Emulation is for development hosts; KVM and
            # Firecracker keep the guest's ASLR. SPACE_GUEST_ASLR=1 keeps it under TCG too.
            if not self.guest_aslr:
                cmdline += " norandmaps"
        return cmdline

    def argv(self, config: VMConfig, run_dir: Path) -> list[str]:
        """QEMU's command line. Every file but the kernel, initramfs and memory file comes as
        an inherited descriptor (`_launch` lays them out); the paths in `opaque` only say which
        file each is, and name the run directory for `vmm_pids`."""
        if self.accel == "kvm":
            accel = ["-accel", "kvm", "-cpu", "max"]
        else:
            # A bounded translation cache keeps each TCG VM's host memory small.
            accel = ["-accel", "tcg,tb-size=64", "-cpu", "max"]
        drive_options = DRIVE_OPTIONS + _throttling(self.shares)
        argv = [
            self.binary,
            "-name", f"space-{config.vm_id}",
            "-M", "microvm,isa-serial=on,rtc=on",
            *accel,
            "-m", str(config.memory_mib),
            *_memory_backend(config, self.readonly_private_map),
            "-smp", str(config.vcpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(config.kernel),
            # The command line (with the agent's boot token) in a file of mode 0600, not in
            # argv, which every user of the host can read in /proc.
            "-readconfig", str(run_dir / CONFIG_FILE),
            *_fd_file(DISK_FD, config.rootfs, both=True),
            "-drive", f"id=root,file=/dev/fdset/{DISK_FD},{drive_options},discard=unmap",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id={AGENT_CHARDEV},fd={AGENT_FD},server=on,wait=off",
            "-device", f"virtserialport,chardev={AGENT_CHARDEV},name={AGENT_PORT_NAME}",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            *_fd_file(CONSOLE_FD, run_dir / CONSOLE_LOG),
            "-chardev", f"file,id=console,path=/dev/fdset/{CONSOLE_FD}",
            "-serial", "chardev:console",
            "-chardev", f"socket,id=qmp,fd={QMP_FD},server=on,wait=off",
            "-mon", "chardev=qmp,mode=control",
        ]  # fmt: skip
        if self.jail is not None:
            argv += ["-sandbox", SANDBOX]
        if config.initrd is not None:
            argv += ["-initrd", str(config.initrd)]
        if config.free_page_reporting:
            # Never inflated: the guest only hands back the pages it frees (never with guest
            # RAM in a file: `_memory_backend` says why).
            argv += ["-device", "virtio-balloon-device,free-page-reporting=on"]
        for i, drive in enumerate(config.drives):
            fd = DRIVE_FD + i
            ro = ",readonly=on" if drive.read_only else ""
            argv += [
                *_fd_file(fd, drive.path, both=not drive.read_only),
                "-drive", f"id={DRIVE_ID}{i},file=/dev/fdset/{fd},{drive_options}{ro}",
                "-device", f"virtio-blk-device,drive={DRIVE_ID}{i},serial={drive.serial}",
            ]  # fmt: skip
        if config.has_nic:
            mac = config.guest_mac or "02:00:00:00:00:01"
            argv += [
                "-netdev", f"tap,id=net0,fd={TAP_FD}",
                "-device", f"virtio-net-device,netdev=net0,mac={mac}",
            ]  # fmt: skip
        return argv

    @functools.cached_property
    def readonly_private_map(self) -> bool:
        return qemu_version(self.binary) >= READONLY_PRIVATE_MAP

    @property
    def shares_snapshot_memory(self) -> bool:
        return self.jail is None or self.readonly_private_map

    async def _launch(
        self,
        config: VMConfig,
        run_dir: Path,
        extra: list[str],
        state: Path | None = None,
    ) -> QemuVM:
        # A QEMU that starts takes a CPU until it greets us: fifty at once on two cores would
        # each miss SOCKET_WAIT_S. They take turns instead, a few at a time; the rest wait.
        async with self._starting():
            return await self._launch_now(config, run_dir, extra, state)

    async def _launch_now(
        self, config: VMConfig, run_dir: Path, extra: list[str], state: Path | None
    ) -> QemuVM:
        if shutil.which(self.binary) is None:
            raise VMMError(f"{self.binary} not found: install the qemu-system-x86 package")
        for path in (config.kernel, config.rootfs, config.initrd):
            if path is not None and not path.exists():
                raise VMMError(f"{path} does not exist")
        run_dir.mkdir(parents=True, exist_ok=True)
        config = self._private_memory(config, run_dir)
        _write_private(run_dir / CONFIG_FILE, _machine_config(self._cmdline(config)))
        ours: dict[int, int] = {}
        confinement = None
        try:
            ours.update(_open_files(config, run_dir, state))
            fds = dict(ours)
            if config.tap_fd is not None:
                fds[TAP_FD] = config.tap_fd
            elif config.tap_device is not None:
                ours[TAP_FD] = fds[TAP_FD] = open_tap_device(config.tap_device)
                if self.jail is not None and _in_host_namespace(fds[TAP_FD]):
                    raise VMMError(
                        f"tap {config.tap_device} is in the host's network namespace: a jailed "
                        "VMM would join it; open it inside the sandbox's namespace"
                    )
            if self.jail is not None:
                confinement = self._confine(config, run_dir, TAP_FD if TAP_FD in fds else None)
            proc = VMMProcess.spawn(
                [*self.argv(config, run_dir), *extra], run_dir / QEMU_LOG, fds, confinement
            )
        except BaseException:
            if confinement is not None and self.jail is not None:
                self.jail.release(confinement.record())
            raise
        finally:
            for fd in ours.values():
                os.close(fd)
        record = confinement.record() if confinement is not None else None
        vm = QemuVM(config, run_dir, proc, self.accel, self.jail, record)
        try:
            await vm.connect_qmp()
        except BaseException:
            await vm.kill()
            raise
        finally:
            # QEMU read it before it opened its QMP socket; the token has no business on disk.
            (run_dir / CONFIG_FILE).unlink(missing_ok=True)
        return vm

    def _private_memory(self, config: VMConfig, run_dir: Path) -> VMConfig:
        """A jailed VMM never gets write access to a file another VM maps: where this QEMU
        cannot map a snapshot's memory file privately from a read-only descriptor, the VM maps
        a reflink of its own (sharing the disk's extents, not the page cache)."""
        if self.shares_snapshot_memory or config.memory_file is None or config.memory_shared:
            return config
        own = run_dir / MEMORY_FILE
        if config.memory_file != own:
            own.unlink(missing_ok=True)
            clone_file(config.memory_file, own)
        return config.with_changes(memory_file=own)

    def _confine(self, config: VMConfig, run_dir: Path, tap_fd: int | None) -> Confinement:
        assert self.jail is not None
        exe = shutil.which(self.binary)
        assert exe is not None
        read_only = [config.kernel, run_dir / CONFIG_FILE]
        if config.initrd is not None:
            read_only.append(config.initrd)
        writable = []
        memory = config.memory_file
        if memory is not None:
            if config.memory_shared or not self.readonly_private_map:
                memory.touch(mode=0o600)  # QEMU would make it; in its jail it makes nothing
                writable.append(memory)
            else:
                read_only.append(memory)
        devices = ["/dev/null", "/dev/zero", "/dev/urandom"]
        if self.accel == "kvm":
            devices.append("/dev/kvm")
        confinement = self.jail.confine(
            config.vm_id, exe=str(Path(exe).resolve()), vcpus=config.vcpus,
            memory_mib=config.memory_mib, read_only=read_only, writable=writable,
            devices=devices, tap_fd=tap_fd,
        )  # fmt: skip
        uid = confinement.uid
        try:
            for path in (run_dir / CONFIG_FILE, *writable):
                os.chown(path, uid, uid)
            for path in read_only:
                if path != run_dir / CONFIG_FILE:  # the token's file: the VMM's own, 0600
                    _readable(path)
        except BaseException:
            self.jail.release(confinement.record())
            raise
        return confinement

    async def adopt(self, run_dir: Path) -> QemuVM:
        """Take over a VM a previous worker process started (it is found by its run dir)."""
        try:
            record = json.loads((run_dir / VM_FILE).read_text())
            formats.check("vm", record, run_dir / VM_FILE)
        except (OSError, ValueError) as e:
            raise VMGone(f"{run_dir} holds no adoptable VM: {e}") from None
        config = VMConfig.from_json(record["config"])
        proc = VMMProcess.adopt(int(record["pid"]), f"{run_dir}/")
        # VMs an earlier version started run unjailed until their next start.
        jail = record.get("jail")
        vm = QemuVM(config, run_dir, proc, str(record.get("accel", self.accel)), self.jail, jail)
        try:
            await vm.connect_qmp()
            status = await vm.query_status()
        except BaseException:
            await vm.detach()
            raise
        vm._state = VMState.PAUSED if status in ("paused", "postmigrate") else VMState.RUNNING
        return vm

    async def probe(self, vm: VM, timeout: float) -> str:
        assert isinstance(vm, QemuVM)
        return await vm.query_status(timeout)

    async def boot(self, config: VMConfig, run_dir: Path) -> VM:
        if not self.mapped_memory:
            config = config.with_changes(memory_file=None, memory_shared=False)
        config = config.with_changes(
            free_page_reporting=self.free_page_reporting and config.memory_file is None
        )
        vm = await self._launch(config, run_dir, [])
        vm.mark_running()
        return vm

    async def restore(
        self, snapshot: SnapshotInfo, config: VMConfig, run_dir: Path, *, paused: bool = False
    ) -> VM:
        if snapshot.driver != self.name:
            raise VMMError(f"snapshot {snapshot.path} was made by {snapshot.driver}, not qemu")
        _check_same_machine(snapshot.config, config)
        state = snapshot.path / snapshot.files["state"]
        if not state.exists():
            raise VMMError(f"snapshot {snapshot.path} has no {snapshot.files['state']}")
        memory = snapshot.files.get("memory")
        if memory:
            if not (snapshot.path / memory).is_file():
                raise VMMError(f"snapshot {snapshot.path} has no {memory}")
            # A snapshot's memory file is mapped privately: the guest reads its pages as it
            # touches them, clones share those they have not written, and what a clone writes is
            # its own.
            config = config.with_changes(memory_file=snapshot.path / memory, memory_shared=False)
        elif not (self.mapped_memory and config.memory_shared and not config.free_page_reporting):
            # A stream is loaded into anonymous memory, unless the caller makes a snapshot
            # source of it: then into a file of its own that its snapshots keep (no balloon).
            config = config.with_changes(memory_file=None, memory_shared=False)
        # QEMU reads the state straight from an inherited descriptor: no `cat`, no pipe. A
        # stream that leaves RAM out is read only once the capability that says so is set.
        # `-S`: once loaded the guest stays stopped, as a paused VM's snapshot leaves it, even
        # when the state is a live snapshot's (which QEMU would otherwise start by itself):
        # the agent's stream is connected before it runs, and `paused` holds for every state.
        incoming = ["-S", "-incoming", "defer" if memory else f"fd:{STATE_FD}"]
        vm = await self._launch(config, run_dir, incoming, state)
        # The incoming migration runs before QEMU starts the vCPUs; we start them.
        try:
            if memory:
                ignore_shared = _capabilities(**{IGNORE_SHARED: True})
                await vm._execute("migrate-set-capabilities", ignore_shared)
                await vm._execute("migrate-incoming", {"uri": f"fd:{STATE_FD}"})
            while True:
                status = await vm.query_status(LOAD_TIMEOUT_S)
                if status == "running":
                    break
                if status == "paused":
                    await vm._connect_paused()
                    if paused:
                        vm._state = VMState.PAUSED
                        vm.save()
                        return vm
                    await vm._execute("cont")
                    continue
                if status not in ("inmigrate", "prelaunch", "restore-vm"):
                    raise VMMError(f"restore of {snapshot.path} ended in state {status!r}")
                await asyncio.sleep(0.002)
        except BaseException:
            await vm.kill()
            raise
        vm.mark_running()
        return vm


def _memory_backend(config: VMConfig, readonly_private_map: bool) -> list[str]:
    if config.memory_file is None:
        return []
    if config.free_page_reporting:
        # QEMU 7.2 discards a freed page of file-backed RAM by punching a hole in the file: in
        # a snapshot's file that every clone maps, that would zero their pages too.
        raise VMMError(f"VM {config.vm_id}: guest RAM in a file cannot have a reporting balloon")
    share = "on" if config.memory_shared else "off"
    backend = (f"memory-backend-file,id={RAM_ID},size={config.memory_mib}M,"
               f"mem-path={_qemu_path(config.memory_file)},share={share}")  # fmt: skip
    if not config.memory_shared and readonly_private_map:
        backend += ",readonly=on,rom=off"
    return ["-object", backend, "-machine", f"memory-backend={RAM_ID}"]


def _tail(path: Path, lines: int) -> str:
    """The last `lines` lines of a log the VMM or its guest wrote, joined on one line."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


def _capabilities(**states: bool) -> dict[str, Any]:
    return {"capabilities": [{"capability": k, "state": v} for k, v in states.items()]}


def _check_same_machine(saved: VMConfig, new: VMConfig) -> None:
    for field in ("vcpus", "memory_mib", "kernel", "initrd"):
        if getattr(saved, field) != getattr(new, field):
            raise VMMError(
                f"cannot restore: {field} is {getattr(new, field)} but the snapshot has "
                f"{getattr(saved, field)}"
            )
    if saved.has_nic != new.has_nic:
        raise VMMError("cannot restore: the snapshot's VM and this one differ in network devices")
    if saved.free_page_reporting != new.free_page_reporting:
        raise VMMError("cannot restore: the snapshot's VM and this one differ in balloon devices")
    if len(saved.drives) != len(new.drives):
        raise VMMError(
            f"cannot restore: the snapshot's VM has {len(saved.drives)} extra drives, this one "
            f"{len(new.drives)}"
        )


@functools.cache
def host_tsc_khz() -> int | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return round(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def _machine_config(cmdline: str) -> str:
    """A -readconfig file that sets the kernel command line (QEMU's `append` machine option)."""
    # QEMU's config parser takes a value up to its next double quote, 1023 bytes at most.
    if '"' in cmdline or len(cmdline) > 1023:
        raise VMMError(f"kernel command line unusable in a QEMU config file: {cmdline[:80]}…")
    return f'[machine]\n  append = "{cmdline}"\n'


@functools.cache
def qemu_version(binary: str) -> tuple[int, int]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        major, minor = out.stdout.split("version ", 1)[1].split(".")[:2]
        return int(major), int(minor)
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return (0, 0)


def _fd_file(fd: int, path: Path, both: bool = False) -> list[str]:
    """Descriptor `fd` as QEMU's /dev/fdset/`fd` (with `both`, its read-only twin too)."""
    argv = ["-add-fd", f"fd={fd},set={fd},opaque={_qemu_path(path)}"]
    if both:
        argv += ["-add-fd", f"fd={fd + READ_FD_OFFSET},set={fd},opaque={_qemu_path(path)}"]
    return argv


def _open_files(config: VMConfig, run_dir: Path, state: Path | None) -> dict[int, int]:
    """The descriptors QEMU is given, child fd: ours; closed by the caller."""
    fds: dict[int, int] = {}
    try:
        if state is not None:
            fds[STATE_FD] = os.open(state, os.O_RDONLY | os.O_CLOEXEC)
        fds[QMP_FD] = _listen(run_dir / QMP_SOCKET)
        fds[AGENT_FD] = _listen(run_dir / AGENT_SOCKET)
        console = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        fds[CONSOLE_FD] = os.open(run_dir / CONSOLE_LOG, console, 0o600)
        fds[DISK_FD] = os.open(config.rootfs, os.O_RDWR | os.O_CLOEXEC)
        fds[DISK_FD + READ_FD_OFFSET] = os.open(config.rootfs, os.O_RDONLY | os.O_CLOEXEC)
        for i, drive in enumerate(config.drives):
            if drive.placeholder:
                # An empty slot of its own: nothing another VM opens.
                path, mode = run_dir / f"slot{i}", os.O_RDWR | os.O_CREAT | os.O_TRUNC
            else:
                path, mode = drive.path, os.O_RDONLY if drive.read_only else os.O_RDWR
            fds[DRIVE_FD + i] = os.open(path, mode | os.O_CLOEXEC, 0o600)
            if not drive.read_only:
                fds[DRIVE_FD + i + READ_FD_OFFSET] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def _throttling(shares: Shares | None) -> str:
    """Every drive of a VM in one throttle group: the limits hold for all its disks together."""
    if shares is None or not (shares.disk_mib_s or shares.disk_iops):
        return ""
    options = ",throttling.group=disk"
    if shares.disk_mib_s:
        options += f",throttling.bps-total={shares.disk_mib_s << 20}"
    if shares.disk_iops:
        options += f",throttling.iops-total={shares.disk_iops}"
    return options


def _in_host_namespace(tap_fd: int) -> bool:
    """Whether the tap lives in the worker's own namespace. /proc/self names the thread group,
    so this holds from a thread that entered another namespace; /proc/1 may be out of reach
    (a container's init belongs to another user namespace)."""
    netns = tap_namespace(tap_fd)
    try:
        tap, own = os.fstat(netns), os.stat("/proc/self/ns/net")
        return (tap.st_dev, tap.st_ino) == (own.st_dev, own.st_ino)
    finally:
        os.close(netns)


def _listen(path: Path) -> int:
    """A listening unix socket at `path` (replacing a stale one), for QEMU to accept on."""
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(8)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def _readable(path: Path) -> None:
    """A file the jailed VMM reads by path must be readable by any uid (its directories on the
    host need not be: inside the jail they are the jail's own)."""
    mode = path.stat().st_mode
    if mode & stat.S_IROTH == 0:
        path.chmod(mode | stat.S_IROTH)


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _qemu_path(path: Path) -> str:
    # QEMU's -drive splits options on commas; a doubled comma is a literal one.
    return str(path).replace(",", ",,")

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
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

from qemu.qmp import ConnectError, QMPClient

from space.guest.protocol import AGENT_PORT_NAME
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
    VMState,
    VMStateError,
    VMStatus,
)
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
STATE_FD = 3
TAP_FD = 4
SOCKET_WAIT_S = 10.0
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
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self.accel = accel
        self._proc = process
        self._qmp: QMPClient | None = None
        self._state = VMState.STARTING
        self._reason: str | None = None
        self._ending = False  # stop/kill asked for: the exit is not a crash
        self._exited = asyncio.Event()
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
            detail = self._qemu_log_tail()
            self._reason = f"VMM process {how}" + (f": {detail}" if detail else "")
            log.warning("vm %s: %s", self.id, self._reason)
        elif self._state != VMState.CRASHED:
            self._state = VMState.STOPPED
        self._exited.set()
        await self._release()

    def _qemu_log_tail(self) -> str:
        try:
            lines = (self.run_dir / QEMU_LOG).read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-3:])

    async def _release(self) -> None:
        """Remove everything this VM made; never the caller's disk."""
        if self._qmp is not None:
            with contextlib.suppress(Exception):
                await self._qmp.disconnect()
            self._qmp = None
        for name in (QMP_SOCKET, AGENT_SOCKET, VM_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / name).unlink()

    def _check_alive(self) -> None:
        if self._exited.is_set() or not self._proc.alive:
            raise VMGone(self._reason or f"VM {self.id} is no longer running")

    async def connect_qmp(self) -> None:
        sock = self.run_dir / QMP_SOCKET
        deadline = time.monotonic() + SOCKET_WAIT_S
        while True:
            # The socket file appears when QEMU binds it, a moment before it listens.
            if sock.exists():
                qmp = QMPClient(f"vm-{self.id}")
                try:
                    await qmp.connect(str(sock))
                except ConnectError:
                    pass
                else:
                    self._qmp = qmp
                    return
            self._check_alive()
            if time.monotonic() > deadline:
                raise VMMError(f"QEMU did not open its QMP socket within {SOCKET_WAIT_S}s")
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
            raise
        except Exception as e:
            self._check_alive()
            raise VMMError(f"QMP {cmd} failed: {e}") from e

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
        record = {
            "driver": "qemu",
            "pid": self._proc.pid,
            "accel": self.accel,
            "config": self.config.to_json(),
        }
        tmp = self.run_dir / (VM_FILE + ".tmp")
        tmp.write_text(json.dumps(record))
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
        await self._execute("migrate", {"uri": f"exec:cat > {shlex.quote(str(state))}"})
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
        return await asyncio.open_unix_connection(str(self.run_dir / AGENT_SOCKET), limit=1 << 22)

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
    ) -> None:
        if accel not in ("tcg", "kvm"):
            raise ValueError(f"accel must be 'tcg' or 'kvm', not {accel!r}")
        self.binary = binary
        self.accel = accel
        self.guest_aslr = guest_aslr
        self.free_page_reporting = free_page_reporting
        self.mapped_memory = mapped_memory

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
        if self.accel == "kvm":
            accel = ["-accel", "kvm", "-cpu", "max"]
        else:
            # A bounded translation cache keeps each TCG VM's host memory small.
            accel = ["-accel", "tcg,tb-size=64", "-cpu", "max"]
        argv = [
            self.binary,
            "-name", f"space-{config.vm_id}",
            "-M", "microvm,isa-serial=on,rtc=on",
            *accel,
            "-m", str(config.memory_mib),
            *_memory_backend(config),
            "-smp", str(config.vcpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(config.kernel),
            # The command line (with the agent's boot token) in a file of mode 0600, not in
            # argv, which every user of the host can read in /proc.
            "-readconfig", str(run_dir / CONFIG_FILE),
            "-drive", f"id=root,file={_qemu_path(config.rootfs)},format=raw,if=none,discard=unmap",
            "-device", "virtio-blk-device,drive=root",
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=agent,path={run_dir / AGENT_SOCKET},server=on,wait=off",
            "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME}",
            "-object", "rng-random,id=rng,filename=/dev/urandom",
            "-device", "virtio-rng-device,rng=rng",
            "-chardev", f"file,id=console,path={run_dir / CONSOLE_LOG}",
            "-serial", "chardev:console",
            "-qmp", f"unix:{run_dir / QMP_SOCKET},server=on,wait=off",
        ]  # fmt: skip
        if config.initrd is not None:
            argv += ["-initrd", str(config.initrd)]
        if config.free_page_reporting:
            # Never inflated: the guest only hands back the pages it frees (never with guest
            # RAM in a file: `_memory_backend` says why).
            argv += ["-device", "virtio-balloon-device,free-page-reporting=on"]
        for i, drive in enumerate(config.drives):
            ro = ",readonly=on" if drive.read_only else ""
            ro += ",file.locking=off" if drive.placeholder else ""
            argv += [
                "-drive", f"id={DRIVE_ID}{i},file={_qemu_path(drive.path)},format=raw,if=none{ro}",
                "-device", f"virtio-blk-device,drive={DRIVE_ID}{i},serial={drive.serial}",
            ]  # fmt: skip
        if config.has_nic:
            mac = config.guest_mac or "02:00:00:00:00:01"
            tap = (f"fd={TAP_FD}" if config.tap_fd is not None
                   else f"ifname={config.tap_device},script=no,downscript=no")  # fmt: skip
            argv += [
                "-netdev", f"tap,id=net0,{tap}",
                "-device", f"virtio-net-device,netdev=net0,mac={mac}",
            ]  # fmt: skip
        return argv

    async def _launch(
        self,
        config: VMConfig,
        run_dir: Path,
        extra: list[str],
        read_files: dict[int, Path] | None = None,
    ) -> QemuVM:
        if shutil.which(self.binary) is None:
            raise VMMError(f"{self.binary} not found: install the qemu-system-x86 package")
        for path in (config.kernel, config.rootfs, config.initrd):
            if path is not None and not path.exists():
                raise VMMError(f"{path} does not exist")
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (QMP_SOCKET, AGENT_SOCKET):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / name).unlink()
        _write_private(run_dir / CONFIG_FILE, _machine_config(self._cmdline(config)))
        fds = {TAP_FD: config.tap_fd} if config.tap_fd is not None else {}
        proc = VMMProcess.spawn(
            [*self.argv(config, run_dir), *extra], run_dir / QEMU_LOG, read_files, fds
        )
        vm = QemuVM(config, run_dir, proc, self.accel)
        try:
            await vm.connect_qmp()
        except BaseException:
            await vm.kill()
            raise
        finally:
            # QEMU read it before it opened its QMP socket; the token has no business on disk.
            (run_dir / CONFIG_FILE).unlink(missing_ok=True)
        return vm

    async def adopt(self, run_dir: Path) -> QemuVM:
        """Take over a VM a previous worker process started (it is found by its run dir)."""
        try:
            record = json.loads((run_dir / VM_FILE).read_text())
        except (OSError, ValueError) as e:
            raise VMGone(f"{run_dir} holds no adoptable VM: {e}") from None
        config = VMConfig.from_json(record["config"])
        proc = VMMProcess.adopt(int(record["pid"]), str(run_dir / QMP_SOCKET))
        vm = QemuVM(config, run_dir, proc, str(record.get("accel", self.accel)))
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
        incoming = ["-incoming", "defer" if memory else f"fd:{STATE_FD}"]
        vm = await self._launch(config, run_dir, incoming, read_files={STATE_FD: state})
        # The incoming migration runs before QEMU starts the vCPUs. The snapshot was taken of a
        # paused VM, so once loaded it is paused too, and we start it.
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


def _memory_backend(config: VMConfig) -> list[str]:
    if config.memory_file is None:
        return []
    if config.free_page_reporting:
        # QEMU 7.2 discards a freed page of file-backed RAM by punching a hole in the file: in
        # a snapshot's file that every clone maps, that would zero their pages too.
        raise VMMError(f"VM {config.vm_id}: guest RAM in a file cannot have a reporting balloon")
    share = "on" if config.memory_shared else "off"
    backend = (f"memory-backend-file,id={RAM_ID},size={config.memory_mib}M,"
               f"mem-path={_qemu_path(config.memory_file)},share={share}")  # fmt: skip
    return ["-object", backend, "-machine", f"memory-backend={RAM_ID}"]


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


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _qemu_path(path: Path) -> str:
    # QEMU's -drive splits options on commas; a doubled comma is a literal one.
    return str(path).replace(",", ",,")

"""The Firecracker driver: boots, pauses, snapshots and restores microVMs through Firecracker.

One `FirecrackerVM` owns one Firecracker process (started directly, or through the jailer) and
every file made for it, and removes them all in `close()` / `stop()` / `kill()`.

Firecracker runs with its working directory set to its own root — the VM's `run_dir`, or `/`
inside the jail — and every file it opens is named relative to that root (`rootfs`,
`vsock.sock`, …). Firecracker records the disk path and the vsock path in its snapshots and
reopens them on restore, so relative names let a snapshot be restored in another directory
(another VM, the original long gone): the restored process finds *its* `rootfs` (a symlink to
the caller's disk; a hard link in the jail) where the snapshot says. Outside the jail the
kernel, initrd and disk are symlinks in `run_dir`; the caller's files are never removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO, TypeVar

from space.settings import Shares
from space.worker.network.manager import tap_device_name, tap_namespace
from space.worker.vmm.base import (
    SNAPSHOT_DISK,
    SNAPSHOT_MANIFEST,
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
from space.worker.vmm.firecracker.client import (
    BootSource,
    Drive,
    FirecrackerClient,
    FirecrackerConnectionError,
    LogLevel,
    NetworkInterface,
    RateLimiter,
    SnapshotLoadParams,
    socket_path,
)
from space.worker.vmm.firecracker.jailer import (
    JAILED_API_SOCKET,
    CopyMethod,
    JailerConfig,
    cgroup_dir,
    chroot_root,
    clone_file,
    jail_dir,
    jailer_argv,
    place_file,
    prepare_jail,
    validate_instance_id,
)
from space.worker.vmm.firecracker.vsock import connect_hybrid_vsock

log = logging.getLogger(__name__)

DRIVER_NAME = "firecracker"
AGENT_VSOCK_PORT = 1024  # where the guest agent listens
GUEST_CID = 3  # the lowest CID a guest may have; each VM has its own vsock device
ROOT_DRIVE_ID = "rootfs"
IFACE_ID = "eth0"
CMDLINE_EXTRA = "reboot=k pci=off"  # a guest reboot ends Firecracker; no PCI bus to probe
MAX_VCPUS = 32  # Firecracker's limit

# Names inside the VMM's root (run_dir, or the jail). Firecracker opens them relative to it.
KERNEL = "vmlinux"
INITRD = "initrd"
ROOTFS = "rootfs"
DRIVE_ID = "drive"  # extra drives: drive0, drive1, … (both their id and their file's name)
VSOCK_SOCKET = "vsock.sock"
VMM_LOG = "firecracker.log"
METRICS = "metrics.json"
CONSOLE_LOG = "console.log"  # Firecracker's stdout: the guest's serial console
STDERR_LOG = "firecracker.stderr"
API_SOCKET = "firecracker.socket"  # in run_dir; in the jail it is JAILED_API_SOCKET
JAILED_SNAPSHOT_DIR = "snapshot"
SNAPSHOT_STATE = "vmstate"
SNAPSHOT_MEMORY = "memory"

JailerFactory = Callable[[VMConfig], JailerConfig]
T = TypeVar("T")


class FirecrackerDriver(Driver):
    """Makes VMs with Firecracker, optionally inside its jailer.

    `jailer`, when given, builds the jail for each VM (so the id, uid or netns can differ per
    VM); its `firecracker_binary` replaces `firecracker_bin`.
    """

    name = DRIVER_NAME

    def __init__(
        self,
        firecracker_bin: Path | str = "firecracker",
        *,
        jailer: JailerFactory | None = None,
        on_release: Callable[[JailerConfig], None] | None = None,
        firecracker_args: Sequence[str] = (),
        log_level: LogLevel = "Warning",  # at Info, Firecracker logs request bodies: the token
        api_timeout: float = 30.0,
        start_timeout: float = 10.0,
        vsock_timeout: float = 5.0,
        free_page_reporting: bool = True,
        shares: Shares | None = None,
    ) -> None:
        self.firecracker_bin = firecracker_bin
        self.shares = shares
        self.free_page_reporting = free_page_reporting
        self.jailer = jailer
        self.on_release = on_release  # once a jail this driver made is gone (its uid, cgroup)
        self.firecracker_args = tuple(firecracker_args)
        self.log_level: LogLevel = log_level
        self.api_timeout = api_timeout
        self.start_timeout = start_timeout
        self.vsock_timeout = vsock_timeout

    async def boot(self, config: VMConfig, run_dir: Path) -> FirecrackerVM:
        # Firecracker's snapshots always keep memory as a file, which its restores map.
        config = _named_tap(config).with_changes(
            free_page_reporting=self.free_page_reporting, memory_file=None, memory_shared=False
        )
        _check_files(config)
        if not 1 <= config.vcpus <= MAX_VCPUS:
            raise VMMError(f"Firecracker supports 1 to {MAX_VCPUS} vCPUs, not {config.vcpus}")
        if config.memory_mib < 1:
            raise VMMError(f"memory_mib must be positive, not {config.memory_mib}")
        files = [
            (config.kernel, KERNEL, False),
            (config.rootfs, ROOTFS, True),
            *_drive_files(config),
        ]
        if config.initrd is not None:
            files.append((config.initrd, INITRD, False))
        vm = await self._launch(config, run_dir, files)
        try:
            await vm._setup_logging(self.log_level)
            client = vm._client
            await client.put_machine_config(
                {"vcpu_count": config.vcpus, "mem_size_mib": config.memory_mib, "smt": False}
            )
            boot_source: BootSource = {
                "kernel_image_path": KERNEL,
                "boot_args": f"{config.kernel_cmdline('ttyS0')} {CMDLINE_EXTRA}",
            }
            if config.initrd is not None:
                boot_source["initrd_path"] = INITRD
            await client.put_boot_source(boot_source)
            limiter = _disk_limiter(self.shares)
            await client.put_drive(_drive(ROOT_DRIVE_ID, ROOTFS, limiter, root=True))
            for i, drive in enumerate(config.drives):
                name = f"{DRIVE_ID}{i}"
                await client.put_drive(_drive(name, name, limiter, read_only=drive.read_only))
            if config.tap_device:
                iface: NetworkInterface = {"iface_id": IFACE_ID, "host_dev_name": config.tap_device}
                if config.guest_mac:
                    iface["guest_mac"] = config.guest_mac
                await client.put_network_interface(iface)
            await client.put_vsock({"guest_cid": GUEST_CID, "uds_path": VSOCK_SOCKET})
            await client.put_entropy()
            if config.free_page_reporting:
                # Never inflated: only the pages the guest frees go back to the host.
                await client.put_balloon(
                    {"amount_mib": 0, "deflate_on_oom": False, "free_page_reporting": True}
                )
            if vm._serial_to_file:
                await client.put_serial({"serial_out_path": CONSOLE_LOG})
            await client.instance_start()
        except BaseException as exc:
            raise await vm._fail("boot", exc) from exc
        vm._state = VMState.RUNNING
        return vm

    async def restore(
        self, snapshot: SnapshotInfo, config: VMConfig, run_dir: Path, *, paused: bool = False
    ) -> FirecrackerVM:
        _check_restorable(snapshot, config)
        # Its own memory file, always.
        config = _named_tap(config).with_changes(memory_file=None, memory_shared=False)
        state_file = snapshot.path / snapshot.files["state"]
        memory_file = snapshot.path / snapshot.files["memory"]
        # Drives are found by the names the snapshot recorded: other files under those names
        # put volumes in a restored VM's slots.
        files = [(config.rootfs, ROOTFS, True), *_drive_files(config)]
        if self.jailer is not None:
            # Inside the jail Firecracker cannot see the snapshot directory.
            files += [(state_file, SNAPSHOT_STATE, False), (memory_file, SNAPSHOT_MEMORY, False)]
        vm = await self._launch(config, run_dir, files)
        try:
            await vm._setup_logging(self.log_level)
            jailed = self.jailer is not None
            params: SnapshotLoadParams = {
                "snapshot_path": SNAPSHOT_STATE if jailed else str(state_file),
                "mem_backend": {
                    "backend_type": "File",
                    "backend_path": SNAPSHOT_MEMORY if jailed else str(memory_file),
                },
                "resume_vm": not paused,
                # Explicit, so snapshots whose vsock path was absolute restore here too.
                "vsock_override": {"uds_path": VSOCK_SOCKET},
            }
            if config.tap_device and config.tap_device != snapshot.config.tap_device:
                params["network_overrides"] = [
                    {"iface_id": IFACE_ID, "host_dev_name": config.tap_device}
                ]
            if vm._serial_to_file:
                log.warning(
                    "VM %s: restored under a daemonizing jailer, its serial console is not "
                    "captured (Firecracker accepts no serial config before a snapshot load)",
                    config.vm_id,
                )
            await vm._client.load_snapshot(params)
        except BaseException as exc:
            raise await vm._fail("restore", exc) from exc
        vm._state = VMState.PAUSED if paused else VMState.RUNNING
        return vm

    async def _launch(
        self, config: VMConfig, run_dir: Path, files: list[tuple[Path, str, bool]]
    ) -> FirecrackerVM:
        """Lay out the VMM's root, start the process and wait for its API socket."""
        validate_instance_id(config.vm_id)  # Firecracker's --id rule, checked before we start
        jail = self.jailer(config) if self.jailer is not None else None
        netns: int | None = None
        if config.tap_fd is not None:
            if jail is None:
                raise VMMError(
                    "Firecracker opens its tap by name inside the sandbox's network namespace: "
                    "that takes its jailer (SPACE_WORKER_JAIL=1)"
                )
            # The jailer enters the namespace of the tap we were handed. It closes every fd it
            # inherits first, so it opens ours through /proc, while we hold it open.
            netns = tap_namespace(config.tap_fd)
            jail = replace(jail, netns=Path(f"/proc/{os.getpid()}/fd/{netns}"))
        try:
            return await self._start(config, run_dir, files, jail)
        finally:
            if netns is not None:
                os.close(netns)

    async def _start(
        self,
        config: VMConfig,
        run_dir: Path,
        files: list[tuple[Path, str, bool]],
        jail: JailerConfig | None,
    ) -> FirecrackerVM:
        if jail is None:
            argv = [
                str(_find_binary(self.firecracker_bin)),
                "--api-sock",
                API_SOCKET,  # relative to its cwd: short enough for any run_dir
                "--id",
                config.vm_id,
                *self.firecracker_args,
            ]
        else:
            argv = jailer_argv(jail, self.firecracker_args)
        protect = [config.kernel, config.initrd, config.rootfs, *(d.path for d in config.drives)]
        root = _VMMRoot(run_dir, jail, protect=protect, on_release=self.on_release)
        client: FirecrackerClient | None = None
        try:
            root.prepare()
            client = FirecrackerClient(root.api_socket, timeout=self.api_timeout)
            for source, name, writable in files:
                root.provide(source, name, writable=writable)
            root.new_file(VMM_LOG)
            root.new_file(METRICS)
            serial_to_file = jail is not None and jail.daemonize
            if serial_to_file:
                # The daemonizing jailer sends stdout to /dev/null: the console goes to a file.
                root.new_file(CONSOLE_LOG)
                console = root.host(CONSOLE_LOG)
            else:
                console = run_dir / CONSOLE_LOG
                root.track(console)
            stderr = run_dir / STDERR_LOG
            root.track(stderr)
            with _private_file(console) as out, _private_file(stderr) as err:
                process = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    cwd=root.dir if jail is None else run_dir,
                    # Every VMM gets its own session (see DESIGN.md); a daemonizing jailer calls
                    # setsid() itself, which fails if we already made it a session leader.
                    start_new_session=not (jail is not None and jail.daemonize),
                )
        except BaseException:
            if client is not None:
                await client.aclose()
            root.cleanup()
            raise
        vm = FirecrackerVM(
            config,
            run_dir,
            root,
            process,
            client,
            console_log=console,
            serial_to_file=serial_to_file,
            vsock_timeout=self.vsock_timeout,
        )
        log.info("VM %s: started Firecracker (pid %d): %s", config.vm_id, process.pid, argv)
        try:
            await vm._client.wait_ready(
                self.start_timeout, alive=lambda: process.returncode is None
            )
        except BaseException as exc:
            raise await vm._fail("start", exc) from exc
        return vm


class FirecrackerVM(VM):
    """One Firecracker process, its API client, and the files made for it."""

    def __init__(
        self,
        config: VMConfig,
        run_dir: Path,
        root: _VMMRoot,
        process: asyncio.subprocess.Process,
        client: FirecrackerClient,
        *,
        console_log: Path,
        serial_to_file: bool,
        vsock_timeout: float,
    ) -> None:
        self.config = config
        self.run_dir = run_dir
        self._root = root
        self._process = process
        self._client = client
        self._console_log = console_log
        self._serial_to_file = serial_to_file
        self._vsock_timeout = vsock_timeout
        self._state = VMState.STARTING
        self._reason: str | None = None
        self._exit_code: int | None = None
        self._ending = False  # stop()/kill() asked for the exit: it is not a crash
        self._released = False
        self.last_snapshot_disk_copy: CopyMethod | None = None
        self._watcher = asyncio.create_task(self._watch(), name=f"firecracker-{config.vm_id}")

    # -- what the worker sees -------------------------------------------------------------------

    def status(self) -> VMStatus:
        return VMStatus(
            state=self._state,
            pid=self._process.pid,
            reason=self._reason,
            exit_code=self._exit_code,
        )

    @property
    def console_log(self) -> Path:
        return self._console_log

    @property
    def api_socket(self) -> Path:
        return self._root.api_socket

    @property
    def vsock_socket(self) -> Path:
        return self._root.host(VSOCK_SOCKET)

    async def pause(self) -> None:
        if self._require_alive() is VMState.PAUSED:
            return
        if self._state is not VMState.RUNNING:
            raise VMStateError(f"VM {self.id} cannot be paused while {self._state}")
        await self._api(self._client.pause())
        self._state = VMState.PAUSED

    async def resume(self) -> None:
        if self._require_alive() is VMState.RUNNING:
            return
        if self._state is not VMState.PAUSED:
            raise VMStateError(f"VM {self.id} cannot be resumed while {self._state}")
        await self._api(self._client.resume())
        self._state = VMState.RUNNING

    async def snapshot(self, dest: Path) -> SnapshotInfo:
        if self._require_alive() not in (VMState.RUNNING, VMState.PAUSED):
            raise VMStateError(f"VM {self.id} cannot be snapshotted while {self._state}")
        names = {"state": SNAPSHOT_STATE, "memory": SNAPSHOT_MEMORY, "disk": SNAPSHOT_DISK}
        dest.mkdir(parents=True, exist_ok=True)
        taken = [n for n in [*names.values(), SNAPSHOT_MANIFEST] if (dest / n).exists()]
        if taken:
            raise VMMError(
                f"{dest} already holds snapshot files ({', '.join(taken)}); use an empty directory"
            )
        started = time.monotonic()
        await self.pause()
        try:
            if self._root.jail is None:
                await self._api(
                    self._client.create_snapshot(
                        {
                            "snapshot_path": str(dest / SNAPSHOT_STATE),
                            "mem_file_path": str(dest / SNAPSHOT_MEMORY),
                            "snapshot_type": "Full",
                        }
                    )
                )
            else:
                # The jailed process can only write inside its jail; move the files out after.
                jailed = self._root.snapshot_dir()
                await self._api(
                    self._client.create_snapshot(
                        {
                            "snapshot_path": f"{JAILED_SNAPSHOT_DIR}/{SNAPSHOT_STATE}",
                            "mem_file_path": f"{JAILED_SNAPSHOT_DIR}/{SNAPSHOT_MEMORY}",
                            "snapshot_type": "Full",
                        }
                    )
                )
                for name in (SNAPSHOT_STATE, SNAPSHOT_MEMORY):
                    await asyncio.to_thread(_move, jailed / name, dest / name)
            # The vCPUs are stopped, so the disk is consistent with the memory image.
            method = await asyncio.to_thread(clone_file, self.config.rootfs, dest / SNAPSHOT_DISK)
        except BaseException:
            for name in names.values():
                with contextlib.suppress(FileNotFoundError):
                    (dest / name).unlink()
            raise
        self.last_snapshot_disk_copy = method
        if method == "copy":
            log.warning(
                "VM %s: %s cannot be reflinked into %s (not btrfs/XFS, or another file system); "
                "the snapshot holds a FULL COPY of the disk",
                self.id,
                self.config.rootfs,
                dest,
            )
        info = SnapshotInfo(
            path=dest,
            driver=DRIVER_NAME,
            config=self.config,
            files=names,
            took_s=time.monotonic() - started,
        )
        info.save()
        return info

    async def stop(self, timeout: float = 5.0) -> VMStatus:
        if self._state in (VMState.STOPPED, VMState.CRASHED):
            await self._release()
            return self.status()
        self._ending = True
        deadline = asyncio.get_running_loop().time() + timeout  # bounds the API calls too
        asked = False
        try:
            async with asyncio.timeout_at(deadline):
                if self._state is VMState.PAUSED:
                    await self._client.resume()  # a paused guest cannot react to Ctrl-Alt-Del
                await self._client.send_ctrl_alt_del()
            asked = True
        except (VMMError, TimeoutError) as exc:
            log.info("VM %s: no graceful shutdown (%s); killing it", self.id, exc or "timeout")
        if asked:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(self._watcher)
        if self._process.returncode is None:
            self._signal(signal.SIGKILL)
            await asyncio.shield(self._watcher)
            reason = (
                f"did not shut down within {timeout:g} s of Ctrl-Alt-Del; killed"
                if asked
                else "killed on request (graceful shutdown was not possible)"
            )
        else:
            await asyncio.shield(self._watcher)
            reason = "shut down on request"
        self._state = VMState.STOPPED
        self._reason = reason
        await self._release()
        return self.status()

    async def kill(self) -> VMStatus:
        if self._state not in (VMState.STOPPED, VMState.CRASHED):
            self._ending = True
            self._signal(signal.SIGKILL)
            await asyncio.shield(self._watcher)
            self._state = VMState.STOPPED
            self._reason = "killed on request"
        await self._release()
        return self.status()

    async def wait(self) -> VMStatus:
        await asyncio.shield(self._watcher)
        return self.status()

    async def close(self) -> None:
        if self._state not in (VMState.STOPPED, VMState.CRASHED):
            await self.kill()
        else:
            await self._release()

    async def open_agent_stream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        self._require_alive()
        return await connect_hybrid_vsock(
            self.vsock_socket, AGENT_VSOCK_PORT, timeout=self._vsock_timeout
        )

    # -- internals ------------------------------------------------------------------------------

    async def _setup_logging(self, level: LogLevel) -> None:
        await self._client.put_logger(
            {"log_path": VMM_LOG, "level": level, "show_level": True, "show_log_origin": False}
        )
        await self._client.put_metrics({"metrics_path": METRICS})

    async def _watch(self) -> None:
        code = await self._process.wait()
        self._exit_code = code
        if self._ending:
            return
        self._state = VMState.CRASHED
        self._reason = _exit_reason(code)
        log.warning("VM %s: %s", self.id, self._reason)

    def _require_alive(self) -> VMState:
        if self._state in (VMState.STOPPED, VMState.CRASHED):
            raise VMGone(f"VM {self.id} is {self._state}: {self._reason}")
        return self._state

    async def _api(self, call: Awaitable[T]) -> T:
        """Run an API call; if the connection broke because the VMM died, say so."""
        try:
            return await call
        except FirecrackerConnectionError as exc:
            await asyncio.wait({self._watcher}, timeout=0.5)
            if self._watcher.done():
                raise VMGone(f"VM {self.id}: the VMM process is gone ({self._reason})") from exc
            raise

    def _signal(self, sig: signal.Signals) -> None:
        if self._process.returncode is not None:
            return
        pid = self._process.pid
        try:
            os.killpg(pid, sig)  # the VMM leads its own process group: take all of it
        except ProcessLookupError:
            # A daemonizing jailer may not have called setsid() yet.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    async def _fail(self, step: str, exc: BaseException) -> BaseException:
        """Tear down a VM whose start failed; return the error to raise, with what it printed."""
        if self._process.returncode is None:
            await asyncio.wait({self._watcher}, timeout=0.2)
        said = self._tail()
        exited = self._reason if self._state is VMState.CRASHED else None
        await self.close()
        if not isinstance(exc, Exception):  # cancellation and the like pass through unchanged
            return exc
        detail = f"Firecracker {step} failed for VM {self.id}: {exc}"
        if exited:
            detail += f"; {exited}"
        if said:
            detail += f"; it printed: {said}"
        return VMGone(detail) if exited else VMMError(detail)

    def _tail(self, limit: int = 600) -> str:
        parts = []
        for path in (self._root.run_dir / STDERR_LOG, self._console_log):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").strip()
                if text:
                    parts.append(text[-limit:])
        return " | ".join(parts)

    async def _release(self) -> None:
        if self._released:
            return
        self._released = True
        await self._client.aclose()
        self._root.cleanup()


class _VMMRoot:
    """Where one Firecracker process keeps its files: `run_dir`, or the jail's chroot.

    Remembers everything it creates so `cleanup()` removes exactly that, and never a file of
    the caller's (the kernel, initrd and disk are only ever linked to).
    """

    def __init__(
        self,
        run_dir: Path,
        jail: JailerConfig | None,
        protect: list[Path | None],
        on_release: Callable[[JailerConfig], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.jail = jail
        self._on_release = on_release
        self.dir = chroot_root(jail) if jail is not None else run_dir
        self.api_socket = self.dir / (
            JAILED_API_SOCKET.lstrip("/") if jail is not None else API_SOCKET
        )
        # Computed now: cleanup must work even if the binary they derive from is gone by then.
        self._jail_dir = jail_dir(jail) if jail is not None else None
        self._cgroup = cgroup_dir(jail) if jail is not None else None
        self._made_run_dir = False
        self._made_jail = False
        self._tracked: list[Path] = []
        self._protected = {(st.st_dev, st.st_ino) for st in _stats(protect)}

    def host(self, name: str) -> Path:
        return self.dir / name

    def track(self, path: Path) -> None:
        self._tracked.append(path)

    def prepare(self) -> None:
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True)
            self._made_run_dir = True
        if self.jail is not None:
            prepare_jail(self.jail)
            self._made_jail = True
            # The jailer would create /run itself; we need it now to hold the API socket's
            # directory open (see client.SocketPath). Same mode and owner as the jailer's.
            run = self.api_socket.parent
            run.mkdir(mode=0o700)
            os.chown(run, self.jail.uid, self.jail.gid)
            return
        # Firecracker cannot bind a socket path that exists; remove ours if left by a crash.
        for path in (self.api_socket, self.host(VSOCK_SOCKET)):
            if path.exists() or path.is_symlink():
                if _socket_in_use(path):
                    raise VMMError(f"{path} is in use: another Firecracker runs in {self.run_dir}")
                path.unlink()
        self.track(self.api_socket)
        self.track(self.host(VSOCK_SOCKET))

    def provide(self, source: Path, name: str, *, writable: bool) -> None:
        """Make the caller's `source` reachable by Firecracker as `name`."""
        if self.jail is not None:
            place_file(self.jail, source, name, writable=writable)
            return
        target = self.host(name)
        if target.is_symlink():
            target.unlink()  # a link left by an earlier VM in this directory
        elif target.exists():
            if os.path.samefile(target, source):
                return  # the caller keeps this very file here under our name: use it as is
            raise VMMError(
                f"{target} exists and is not {source}; run_dir must belong to the VM alone"
            )
        target.symlink_to(source.resolve())
        self.track(target)

    def new_file(self, name: str) -> None:
        """An empty file for Firecracker to write (older versions do not create their logs)."""
        path = self.host(name)
        with _private_file(path):
            pass
        if self.jail is not None:
            os.chown(path, self.jail.uid, self.jail.gid)
        else:
            self.track(path)

    def snapshot_dir(self) -> Path:
        assert self.jail is not None
        path = self.host(JAILED_SNAPSHOT_DIR)
        if not path.is_dir():
            path.mkdir(mode=0o700)
            os.chown(path, self.jail.uid, self.jail.gid)
        return path

    def cleanup(self) -> None:
        for path in self._tracked:
            try:
                if not path.is_symlink():
                    st = path.lstat()
                    if (st.st_dev, st.st_ino) in self._protected:
                        continue  # the caller's own file
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not remove %s: %s", path, exc)
        self._tracked.clear()
        if self._jail_dir is not None and self._made_jail:
            # Only links, copies and what Firecracker made: removing them leaves the caller's
            # files (hard-linked disks included) untouched.
            shutil.rmtree(self._jail_dir, ignore_errors=True)
            self._made_jail = False
            if self._cgroup is not None:  # the jailer makes it but never removes it
                try:
                    self._cgroup.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning("could not remove cgroup %s: %s", self._cgroup, exc)
            if self._on_release is not None and self.jail is not None:
                self._on_release(self.jail)
        if self._made_run_dir:
            with contextlib.suppress(OSError):
                self.run_dir.rmdir()  # only if nothing else was put there
            self._made_run_dir = False


def _private_file(path: Path) -> BinaryIO:
    """Create (or empty) a file only its owner can read: logs may show guest or API data."""
    return os.fdopen(
        os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb"
    )


def _stats(paths: list[Path | None]) -> list[os.stat_result]:
    found = []
    for path in paths:
        if path is not None:
            with contextlib.suppress(OSError):
                found.append(path.stat())
    return found


def _socket_in_use(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe, socket_path(path) as name:
        probe.settimeout(0.5)
        try:
            probe.connect(name)
        except OSError:
            return False
        return True


def _find_binary(binary: Path | str) -> Path:
    text = str(binary)
    found = text if "/" in text else shutil.which(text)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        raise VMMError(
            f"Firecracker binary {text!r} not found or not executable; install Firecracker "
            "or give FirecrackerDriver its path"
        )
    return Path(found)


def _named_tap(config: VMConfig) -> VMConfig:
    """A NIC on a tap fd the worker opened: Firecracker takes the tap by its name."""
    if config.tap_fd is None or config.tap_device is not None:
        return config
    return config.with_changes(tap_device=tap_device_name(config.tap_fd))


def _check_files(config: VMConfig) -> None:
    wanted = [("kernel", config.kernel), ("rootfs", config.rootfs)]
    if config.initrd is not None:
        wanted.append(("initrd", config.initrd))
    for what, path in wanted:
        if not path.is_file():
            raise VMMError(f"VM {config.vm_id}: {what} {path} does not exist or is not a file")


def _check_restorable(snapshot: SnapshotInfo, config: VMConfig) -> None:
    if snapshot.driver != DRIVER_NAME:
        raise VMMError(
            f"{snapshot.path} was taken by the {snapshot.driver!r} driver; Firecracker cannot "
            "restore it"
        )
    for role in ("state", "memory"):
        name = snapshot.files.get(role)
        if name is None or not (snapshot.path / name).is_file():
            raise VMMError(f"snapshot {snapshot.path} has no {role} file")
    if not config.rootfs.is_file():
        raise VMMError(
            f"VM {config.vm_id}: rootfs {config.rootfs} does not exist (it should be a copy of "
            f"{snapshot.path / SNAPSHOT_DISK})"
        )
    old = snapshot.config
    mismatches = [
        f"{field} {getattr(config, field)!r} != {getattr(old, field)!r}"
        for field in ("vcpus", "memory_mib", "guest_mac", "free_page_reporting")
        if getattr(config, field) != getattr(old, field)
    ]
    if (config.tap_device is None) != (old.tap_device is None):
        mismatches.append(
            "a network device " + ("is added" if old.tap_device is None else "is removed")
        )
    if mismatches:
        raise VMMError(
            f"VM {config.vm_id} must have the snapshot's machine to restore {snapshot.path}: "
            + "; ".join(mismatches)
        )


def _move(source: Path, dest: Path) -> None:
    try:
        os.replace(source, dest)
    except OSError:
        clone_file(source, dest)  # another file system
        source.unlink()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"VMM process killed by signal {-code} ({name})"
    return f"VMM process exited with code {code}"


def _disk_limiter(shares: Shares | None) -> RateLimiter | None:
    """Firecracker limits each drive on its own: its token buckets refill once a second."""
    if shares is None or not (shares.disk_mib_s or shares.disk_iops):
        return None
    limiter: RateLimiter = {}
    if shares.disk_mib_s:
        limiter["bandwidth"] = {"size": shares.disk_mib_s << 20, "refill_time": 1000}
    if shares.disk_iops:
        limiter["ops"] = {"size": shares.disk_iops, "refill_time": 1000}
    return limiter


def _drive(
    drive_id: str,
    path: str,
    limiter: RateLimiter | None,
    *,
    root: bool = False,
    read_only: bool = False,
) -> Drive:
    drive: Drive = {"drive_id": drive_id, "path_on_host": path, "is_root_device": root,
                    "is_read_only": read_only}  # fmt: skip
    if limiter is not None:
        drive["rate_limiter"] = limiter
    return drive


def _drive_files(config: VMConfig) -> list[tuple[Path, str, bool]]:
    return [(d.path, f"{DRIVE_ID}{i}", not d.read_only) for i, d in enumerate(config.drives)]

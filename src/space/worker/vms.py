"""One worker's VMs, keyed by sandbox id: create, pause, suspend to disk, resume, delete, adopt.

Everything lives under `<pool>/workers/<worker_id>/`:

    vms/<id>/          run directory of a live VM (disk, sockets, vm.json, sandbox.json)
    suspended/<id>/    snapshot of a suspended sandbox, with its sandbox.json
    base/<template>-<vcpus>-<memory>/   the base snapshot every create of that shape restores
    building/<id>/     the VM a base snapshot is being taken of

A create restores the base snapshot of its shape (building it once, from a cold boot, if it is
missing), so it costs a restore, never a boot. Operations on one VM are serialised; a worker
restart leaves VMs running and the next `start()` adopts them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from space.gateway.client import GatewayError
from space.gateway.policy import Policy
from space.worker.agent_client import AgentClient, AgentError, ExecProcess
from space.worker.local import LocalRuntime
from space.worker.machine import BootImages, Machine
from space.worker.network import GUEST_MAC, Egress, NetworkError
from space.worker.templates import TemplateRecord, latest_templates, remove_template
from space.worker.templates.record import agent_user
from space.worker.vmm.base import Drive, SnapshotInfo, VMMError, VMState, VMStateError
from space.worker.vmm.process import VMMProcess, vmm_pids
from space.worker.vmm.qemu import QMP_SOCKET, QemuDriver

log = logging.getLogger(__name__)

SANDBOX_FILE = "sandbox.json"
# Every VM has this many extra drives: empty slots, or the sandbox's volumes. A restore can put
# a volume in a slot (same devices, another file), so volumes need no boot.
VOLUME_SLOTS = 2
EMPTY_SLOT = "empty-slot.img"
START_LOG = "/var/log/space-start.log"  # in the guest: what the template's start command printed
CA_FILE = "/etc/space/ca.pem"  # in the guest: the gateway's CA
CA_BUNDLE = "/etc/space/ca-bundle.pem"  # the system's CAs and the gateway's
CA_ENV = {
    "SSL_CERT_FILE": CA_BUNDLE,
    "REQUESTS_CA_BUNDLE": CA_BUNDLE,
    "CURL_CA_BUNDLE": CA_BUNDLE,
    "NODE_EXTRA_CA_CERTS": CA_FILE,
}
READY_TIMEOUT_S = 300.0
VOLUME_ID = re.compile(r"^[a-z0-9][a-z0-9-]{2,19}$")  # it is the drive's serial: 20 bytes at most
# Finds each volume by its serial and mounts it. A restored VM's guest saw an empty slot (size
# 0, no read-only flag) there: rebinding the virtio driver makes it probe the new disk afresh.
MOUNT_SCRIPT = """
set -e
find_disk() {
  for d in /sys/block/vd*; do
    if [ "$(cat $d/serial)" = "$1" ]; then echo ${d##*/}; return; fi
  done
}
while [ $# -gt 0 ]; do
  serial=$1 target=$2 options=$3; shift 3
  disk=$(find_disk $serial)
  [ -n "$disk" ] || { echo "volume $serial is not attached" >&2; exit 1; }
  if [ "$(cat /sys/block/$disk/size)" = 0 ]; then
    dev=$(basename $(readlink -f /sys/block/$disk/device))
    echo $dev > /sys/bus/virtio/drivers/virtio_blk/unbind
    echo $dev > /sys/bus/virtio/drivers/virtio_blk/bind
    disk=$(find_disk $serial)
  fi
  mkdir -p "$target"
  mount -t ext4 -o "$options" /dev/$disk "$target"
done
"""
LOCK_FILE = "worker.lock"
IMAGES_FILE = "images.json"
VM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
UNREADABLE = (OSError, ValueError, KeyError, TypeError)  # what a damaged sandbox.json raises
ADOPT_TIMEOUT_S = 10.0
RECONNECT_TIMEOUT_S = 10.0


class VMManagerError(Exception):
    """A request the manager refused; the message says what was wrong."""


class InvalidArgument(VMManagerError):
    pass


class VMNotFound(VMManagerError):
    pass


class TemplateNotFound(VMManagerError):
    pass


class WrongState(VMManagerError):
    """The VM is not in a state that allows the operation; `state` is the one it is in."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class NoRoom(VMManagerError):
    """The worker's vCPU or memory capacity would be exceeded."""


class VolumeInUse(VMManagerError):
    """A volume some VM on this worker still has attached."""


class TemplateInUse(VMManagerError):
    """A template some sandbox on this worker was made from."""


@dataclass(frozen=True)
class VolumeMount:
    """A volume in a sandbox: its image's id and size, where the guest mounts it, and how."""

    id: str
    size_mib: int
    path: str
    read_only: bool = False


@dataclass(frozen=True)
class SandboxSpec:
    """What a sandbox was created with; kept next to its VM and its suspended snapshot."""

    template: str
    vcpus: int
    memory_mib: int
    env: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    disk_mib: int = 0  # 0: the template image's own size
    volumes: tuple[VolumeMount, ...] = ()
    # How the template runs processes, unless an exec says otherwise.
    template_env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SandboxSpec:
        volumes = tuple(VolumeMount(**v) for v in data.get("volumes", ()))
        return cls(**{**data, "volumes": volumes})


@dataclass
class SandboxVM:
    """One sandbox's VM on this worker; `machine` is None while it is suspended."""

    id: str
    spec: SandboxSpec
    machine: Machine | None
    boot: str  # how it was first made: "cold" (it built the base snapshot) or "restore"
    took_ms: float
    since: float = field(default_factory=time.monotonic)  # created or adopted at

    @property
    def state(self) -> str:
        """running, paused, suspended, or error (the VMM died)."""
        if self.machine is None:
            return "suspended"
        vm_state = self.machine.status().state
        if vm_state == VMState.PAUSED:
            return "paused"
        if vm_state in (VMState.RUNNING, VMState.STARTING):
            return "running"
        return "error"

    @property
    def reason(self) -> str | None:
        if self.machine is None or self.state != "error":
            return None
        return self.machine.status().reason or "the VM stopped"

    def save(self, directory: Path) -> None:
        record = {"spec": asdict(self.spec), "boot": self.boot, "took_ms": self.took_ms}
        _write_private(directory / SANDBOX_FILE, json.dumps(record))

    @classmethod
    def load(cls, vm_id: str, directory: Path, machine: Machine | None) -> SandboxVM:
        record = json.loads((directory / SANDBOX_FILE).read_text())
        spec = SandboxSpec.from_json(record["spec"])
        return cls(vm_id, spec, machine, str(record["boot"]), float(record["took_ms"]))


class KeyedLock:
    """One asyncio.Lock per key, dropped once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class VMManager:
    def __init__(
        self,
        runtime: LocalRuntime,
        worker_id: str,
        *,
        templates: Mapping[str, BootImages] | None = None,
        capacity_vcpus: int | None = None,
        capacity_memory_mib: int | None = None,
        reconcile_grace_s: float = 30.0,
        base_snapshots: bool = True,
        egress: Egress | None = None,
    ) -> None:
        if not VM_ID.match(worker_id):
            raise ValueError(f"worker id {worker_id!r} must match {VM_ID.pattern}")
        self.worker_id = worker_id
        self.pool = runtime.pool
        self.driver: QemuDriver = runtime.driver
        self.templates: dict[str, BootImages] = dict(templates or {"base": runtime.images})
        self.records: dict[str, TemplateRecord] = {}  # built templates: how they run
        # vCPUs are overcommitted (idle sandboxes barely use theirs); memory is the real bound.
        self.capacity_vcpus = capacity_vcpus or (os.cpu_count() or 1) * 16
        self.capacity_memory_mib = capacity_memory_mib or _mem_total_mib() * 3 // 4
        # A VM younger than this survives /reconcile: the caller's keep-list may predate it.
        self.reconcile_grace_s = reconcile_grace_s
        # Off: every create boots its VM (slow; for hosts or guests where snapshots misbehave).
        self.base_snapshots = base_snapshots
        # Without egress VMs have no NIC at all; with it, each has a tap in a namespace of its
        # own whose traffic only the gateway's policy lets out.
        self.egress = egress
        self._policies: dict[str, Policy] = {}  # in force, in memory only (they hold secrets)
        self._stale: set[str] = set()  # adopted VMs whose policy died with the last worker
        self.root = self.pool.root / "workers" / worker_id
        self.vms_dir = self.root / "vms"
        self.suspended_dir = self.root / "suspended"
        self.base_dir = self.root / "base"
        self.building_dir = self.root / "building"
        # Volumes outlive sandboxes and worker ids: they belong to the host's pool.
        self.volumes_dir = self.pool.root / "volumes"
        self.empty_slot = self.root / EMPTY_SLOT
        self._vms: dict[str, SandboxVM] = {}
        self._reserved: dict[str, tuple[int, int]] = {}
        self._locks = KeyedLock()
        self._base_locks = KeyedLock()
        self._lock_fd: int | None = None

    # --- the worker's lifetime ---------------------------------------------------------------

    async def start(self) -> None:
        """Adopt the VMs a previous worker process left running; list the suspended ones."""
        for d in (self.vms_dir, self.suspended_dir, self.base_dir, self.building_dir,
                  self.volumes_dir):  # fmt: skip
            d.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        self.refresh_templates()
        self.empty_slot.touch(mode=0o600)
        for tmp in self.volumes_dir.glob(".*"):
            tmp.unlink(missing_ok=True)  # a volume image whose making was cut short
        # Work a previous process did not finish: base builds and half-written snapshots.
        for run_dir in self.building_dir.iterdir():
            await _kill_leftover(run_dir)
        for parent in (self.base_dir, self.suspended_dir):
            for tmp in parent.glob(".*"):
                shutil.rmtree(tmp, ignore_errors=True)
        suspended = {p.name for p in self.suspended_dir.iterdir() if (p / SANDBOX_FILE).exists()}
        for run_dir in sorted(self.vms_dir.iterdir()):
            vm_id = run_dir.name
            if vm_id in suspended or not (run_dir / SANDBOX_FILE).exists():
                # Suspended after all (the worker stopped between saving the snapshot and
                # stopping the VM), or a create that never finished: the VM is not wanted.
                await _kill_leftover(run_dir)
                continue
            try:
                sb = SandboxVM.load(vm_id, run_dir, None)
                sb.machine = await self._adopt(run_dir)
            except (VMMError, AgentError, TimeoutError, *UNREADABLE) as e:
                log.warning("VM %s could not be adopted, removing it: %s", vm_id, e)
                await _kill_leftover(run_dir)
                continue
            self._vms[vm_id] = sb
            log.info("adopted VM %s (%s)", vm_id, sb.state)
        for vm_id in sorted(suspended):
            try:
                self._vms[vm_id] = SandboxVM.load(vm_id, self.suspended_dir / vm_id, None)
            except UNREADABLE as e:
                log.warning("suspended sandbox %s is unreadable, removing it: %s", vm_id, e)
                shutil.rmtree(self.suspended_dir / vm_id, ignore_errors=True)
        if self.egress is not None:
            # Policies lived in the last worker's memory: adopted VMs get nothing out until the
            # control plane sends theirs again (it sees `policy: false` in /health).
            live = {sb.id: Policy() for sb in self._vms.values() if sb.machine is not None}
            for vm_id in await self.egress.start(live):
                log.warning("VM %s lost its network (rebuilt); its NIC no longer works", vm_id)
            self._stale = set(live)

    def refresh_templates(self) -> None:
        """Make the newest build of every template built in the pool usable."""
        base = self.templates["base"]
        for name, record in latest_templates(self.pool.root).items():
            if name == "base":
                continue  # the platform's own, from `space image base`
            self.templates[name] = BootImages(base.kernel, base.initrd, record.rootfs)
            self.records[name] = record

    async def remove_template(self, name: str) -> bool:
        """Delete a built template, its base snapshots and every build of it."""
        if name == "base" or name not in self.records:
            return False
        users = sorted(sb.id for sb in self._vms.values() if sb.spec.template == name)
        if users:
            raise TemplateInUse(f"template {name} is used by {', '.join(users)}")
        for snap in self.base_dir.iterdir():
            if snap.name.rsplit("-", 2)[0] == name:
                await asyncio.to_thread(shutil.rmtree, snap, True)
        await asyncio.to_thread(remove_template, self.pool.root, name)
        del self.templates[name], self.records[name]
        return True

    def _take_lock(self) -> None:
        """One process per worker directory: a second would fight the first over its VMs."""
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise VMManagerError(
                f"another process runs worker {self.worker_id} (it holds {self.root / LOCK_FILE})"
            ) from None
        self._lock_fd = fd

    async def _adopt(self, run_dir: Path) -> Machine:
        # A wedged VMM may never greet us on its QMP socket.
        vm = await asyncio.wait_for(self.driver.adopt(run_dir), ADOPT_TIMEOUT_S)
        try:
            paused = vm.status().state == VMState.PAUSED
            if paused:
                await vm.resume()  # only a running guest can answer our hello
            agent = await AgentClient.connect(
                vm.open_agent_stream, vm.config.agent_token, ADOPT_TIMEOUT_S
            )
            if paused:
                await vm.pause()
        except BaseException:
            await vm.close()
            raise
        return Machine(vm, agent, {})

    async def close(self, stop_vms: bool = False) -> None:
        """Let go of every VM: leave them running for the next worker process, or stop them.

        Suspended snapshots stay on disk either way.
        """
        for sb in list(self._vms.values()):
            if sb.machine is None:
                continue
            if stop_vms or sb.state == "error":
                await sb.machine.close()
            else:
                await sb.machine.detach()
        self._vms.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    # --- queries -----------------------------------------------------------------------------

    def vms(self) -> list[SandboxVM]:
        return sorted(self._vms.values(), key=lambda sb: sb.id)

    def get(self, vm_id: str) -> SandboxVM:
        sb = self._vms.get(vm_id)
        if sb is None:
            raise VMNotFound(f"no VM {vm_id!r} on worker {self.worker_id}")
        return sb

    def used(self) -> tuple[int, int]:
        """vCPUs and MiB held by live VMs and by creates under way."""
        held = [(sb.spec.vcpus, sb.spec.memory_mib) for sb in self._vms.values()
                if sb.state in ("running", "paused")]  # fmt: skip
        held += self._reserved.values()
        return sum(v for v, _ in held), sum(m for _, m in held)

    def _reserve(self, vm_id: str, vcpus: int, memory_mib: int) -> None:
        used_vcpus, used_mib = self.used()
        if used_vcpus + vcpus > self.capacity_vcpus:
            raise NoRoom(
                f"no room for {vcpus} vCPUs: {used_vcpus} of {self.capacity_vcpus} are in use"
            )
        if used_mib + memory_mib > self.capacity_memory_mib:
            raise NoRoom(
                f"no room for {memory_mib} MiB: {used_mib} of {self.capacity_memory_mib} MiB "
                "are in use"
            )
        self._reserved[vm_id] = (vcpus, memory_mib)

    # --- lifecycle ---------------------------------------------------------------------------

    async def create(
        self,
        vm_id: str,
        template: str = "base",
        vcpus: int = 1,
        memory_mib: int = 256,
        env: Mapping[str, str] | None = None,
        hostname: str | None = None,
        disk_mib: int = 0,
        warm: bool = False,
        volumes: Sequence[VolumeMount] = (),
        policy: Policy | None = None,
    ) -> SandboxVM:
        """A running VM restored from the base snapshot of its shape; the existing one if any.

        `warm` (for warm-pool members) runs the platform's own `true` through both exec paths
        before answering: a restored VM's first exec pays for translating that path afresh
        (~130 ms under TCG), and a pool member should not hand that cost to its claimer."""
        _check_id(vm_id)
        async with self._locks.hold(vm_id):
            sb = self._vms.get(vm_id)
            if sb is not None:
                if (sb.spec.template, sb.spec.vcpus, sb.spec.memory_mib) != (
                    template, vcpus, memory_mib,
                ):  # fmt: skip
                    raise WrongState(
                        f"VM {vm_id} exists with template {sb.spec.template}, {sb.spec.vcpus} "
                        f"vCPUs and {sb.spec.memory_mib} MiB",
                        sb.state,
                    )
                return sb
            images = self.templates.get(template)
            if images is None:
                known = ", ".join(sorted(self.templates))
                raise TemplateNotFound(f"no template {template!r} on this worker (it has {known})")
            image_mib = images.rootfs.stat().st_size >> 20
            if disk_mib and disk_mib < image_mib:
                raise InvalidArgument(
                    f"disk_mib {disk_mib} is smaller than template {template} ({image_mib} MiB)"
                )
            _check_volumes(volumes)
            record = self.records.get(template)
            spec = SandboxSpec(
                template, vcpus, memory_mib, dict(env or {}), hostname or f"sb-{vm_id}",
                disk_mib, tuple(volumes),
                template_env={**(CA_ENV if self.egress else {}),
                              **(record.env if record else {})},
                workdir=record.workdir if record else None,
                user=record.user if record else None,
            )  # fmt: skip
            self._reserve(vm_id, vcpus, memory_mib)
            try:
                started = time.perf_counter()
                async with self._network(vm_id, policy or Policy()) as tap_fd:
                    machine, boot = await self._make(vm_id, spec, images, tap_fd)
                took_ms = (time.perf_counter() - started) * 1000
                sb = SandboxVM(vm_id, spec, machine, boot, took_ms)
                try:
                    if volumes:
                        await self._mount_volumes(machine, spec.volumes)
                    if disk_mib:
                        try:
                            await machine.grow_disk(disk_mib)
                        except ValueError as e:
                            raise InvalidArgument(str(e)) from None
                    if warm:
                        for argv in (["true"], ["/bin/sh", "-c", "true"]):
                            await machine.agent.run(argv, timeout=30)
                    sb.save(machine.run_dir)
                except BaseException:
                    await machine.close()
                    await self._detach(vm_id)
                    raise
            finally:
                del self._reserved[vm_id]
            self._vms[vm_id] = sb
            log.info("VM %s created (%s) in %.0f ms", vm_id, sb.boot, sb.took_ms)
            return sb

    @contextlib.asynccontextmanager
    async def _network(self, vm_id: str, policy: Policy) -> AsyncIterator[int | None]:
        """The VM's network with `policy` in force, and a tap fd for its VMM (closed after the
        launch); the network is removed again if the launch fails."""
        if self.egress is None:
            yield None
            return
        net = await self.egress.attach(vm_id, policy)
        self._policies[vm_id] = policy
        self._stale.discard(vm_id)
        fd = self.egress.manager.open_tap(net)
        try:
            yield fd
        except BaseException:
            await self._detach(vm_id)
            raise
        finally:
            os.close(fd)

    async def _detach(self, vm_id: str, keep_policy: bool = False) -> None:
        if self.egress is None:
            return
        if not keep_policy:
            self._policies.pop(vm_id, None)
            self._stale.discard(vm_id)
        try:
            await self.egress.detach(vm_id)
        except (GatewayError, NetworkError) as e:
            log.warning("network of %s not fully removed: %s", vm_id, e)

    async def _make(
        self, vm_id: str, spec: SandboxSpec, images: BootImages, tap_fd: int | None
    ) -> tuple[Machine, str]:
        """The sandbox's VM and how it was made: restored from the base snapshot of its shape
        ("restore"; "cold" if that snapshot had to be built first), or booted ("cold")."""
        drives = await self._drives(spec.volumes)
        if self.base_snapshots:
            base, built = await self._base_snapshot(
                spec.template, spec.vcpus, spec.memory_mib, images
            )
            try:
                machine = await Machine.restore(
                    self.driver, self.pool, base, vm_id=vm_id, hostname=spec.hostname,
                    vms_dir=self.vms_dir, drives=drives, tap_fd=tap_fd,
                )  # fmt: skip
                return machine, "cold" if built else "restore"
            except (VMMError, AgentError, TimeoutError) as e:
                # A snapshot that no longer restores (e.g. a QEMU upgrade) must not stop creates:
                # this one boots, and the next one builds the base again.
                log.warning("base snapshot %s failed to restore, booting instead: %s", base.path, e)
                shutil.rmtree(base.path, ignore_errors=True)
        machine = await Machine.boot(
            self.driver, self.pool, images, vm_id=vm_id, vcpus=spec.vcpus,
            memory_mib=spec.memory_mib, hostname=spec.hostname, vms_dir=self.vms_dir,
            drives=drives, tap_fd=tap_fd, guest_mac=GUEST_MAC if tap_fd is not None else None,
        )  # fmt: skip
        if tap_fd is not None:
            await self._install_ca(machine)
        return machine, "cold"

    async def _install_ca(self, machine: Machine) -> None:
        """The gateway's CA in the guest's trust store (a bundle next to the system's), so the
        TLS it terminates verifies; CA_ENV points the usual variables at it."""
        assert self.egress is not None
        pem = await self.egress.gateway.ca_pem()
        await machine.agent.write_file(CA_FILE, pem, make_parents=True)
        script = f"cat /etc/ssl/certs/ca-certificates.crt {CA_FILE} > {CA_BUNDLE} 2>/dev/null" \
                 f" || cp {CA_FILE} {CA_BUNDLE}"  # fmt: skip
        r = await machine.agent.run(["/bin/sh", "-c", script], timeout=30)
        if r.exit_code != 0:
            raise VMManagerError(f"installing the gateway CA failed: {r.stderr.decode()}")

    async def _drives(self, volumes: Sequence[VolumeMount]) -> tuple[Drive, ...]:
        """The VM's extra drives: its volumes' images (made on first use), then empty slots."""
        drives = []
        for v in volumes:
            image = self.volumes_dir / f"{v.id}.img"
            if not image.exists():
                await asyncio.to_thread(_make_volume, image, v.size_mib)
            drives.append(Drive(image, v.id, v.read_only))
        empty = [Drive(self.empty_slot, f"empty{i}", placeholder=True)
                 for i in range(len(drives), VOLUME_SLOTS)]  # fmt: skip
        return (*drives, *empty)

    async def _mount_volumes(self, machine: Machine, volumes: Sequence[VolumeMount]) -> None:
        """Mount each volume where asked. Read-only mounts skip the journal: the device (read-
        only for the VMM too) refuses its replay."""
        args: list[str] = []
        for v in volumes:
            args += [v.id, v.path, "ro,noload" if v.read_only else "rw"]
        r = await machine.agent.run(["/bin/sh", "-c", MOUNT_SCRIPT, "mount-volumes", *args],
                                    timeout=30)  # fmt: skip
        if r.exit_code != 0:
            raise InvalidArgument(
                f"mounting volumes failed: {r.stderr.decode(errors='replace').strip()}"
            )

    async def _base_snapshot(
        self, template: str, vcpus: int, memory_mib: int, images: BootImages
    ) -> tuple[SnapshotInfo, bool]:
        """The base snapshot for this shape, and whether it had to be built just now."""
        key = f"{template}-{vcpus}-{memory_mib}"
        path = self.base_dir / key
        made_from = _images_record(images, nic=self.egress is not None)
        async with self._base_locks.hold(key):
            with contextlib.suppress(OSError, ValueError, VMMError):
                if json.loads((path / IMAGES_FILE).read_text()) == made_from:
                    return SnapshotInfo.load(path), False
                log.info("base snapshot %s was made from other images; rebuilding it", key)
            started = time.perf_counter()
            build_id = f"base-{key}-{uuid.uuid4().hex[:6]}"
            # A NIC too when sandboxes get one (a restore needs the same devices); no egress.
            async with self._network(build_id, Policy()) as tap_fd:
                machine = await Machine.boot(
                    self.driver, self.pool, images, vm_id=build_id, vcpus=vcpus,
                    memory_mib=memory_mib, vms_dir=self.building_dir,
                    drives=await self._drives(()), tap_fd=tap_fd,
                    guest_mac=GUEST_MAC if tap_fd is not None else None,
                )  # fmt: skip
            tmp = self.base_dir / f".{key}.{uuid.uuid4().hex[:8]}"
            try:
                async with machine:
                    if self.egress is not None:
                        await self._install_ca(machine)
                    record = self.records.get(template)
                    if record is not None:
                        await _start_service(machine, record)
                    await machine.snapshot(tmp)
                _write_private(tmp / IMAGES_FILE, json.dumps(made_from))
                shutil.rmtree(path, ignore_errors=True)
                tmp.rename(path)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            finally:
                await self._detach(build_id)
            log.info("base snapshot %s built in %.1f s", key, time.perf_counter() - started)
            return SnapshotInfo.load(path), True

    async def claim(
        self, vm_id: str, env: Mapping[str, str], policy: Policy | None = None
    ) -> SandboxVM:
        """Hand a warm-pool VM to the tenant that claimed it: their environment and egress
        policy, and a fresh clock, RNG state and agent token (it may have waited long)."""
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            machine = _live(sb, "claim")
            if sb.state != "running":
                raise WrongState(f"cannot claim VM {vm_id}: it is {sb.state}", sb.state)
            if not machine.agent.connected:
                await machine.reconnect(RECONNECT_TIMEOUT_S)
            if policy is not None:
                await self._set_policy(vm_id, policy)
            await machine.renew_identity()
            sb.spec = replace(sb.spec, env=dict(env))
            sb.save(machine.run_dir)
            return sb

    async def set_policy(self, vm_id: str, policy: Policy) -> None:
        """A new egress policy for a VM, in force at once."""
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.machine is None:
                self._policies[vm_id] = policy  # in force when it is resumed
                return
            await self._set_policy(vm_id, policy)

    async def _set_policy(self, vm_id: str, policy: Policy) -> None:
        if self.egress is None:
            return  # VMs here have no NIC at all: nothing gets out, whatever the policy
        await self.egress.set_policy(vm_id, policy)
        self._policies[vm_id] = policy
        self._stale.discard(vm_id)

    def policy_known(self, vm_id: str) -> bool:
        """False for a VM whose policy died with an earlier worker process (it is deny-all)."""
        return vm_id not in self._stale

    async def audit(self, vm_id: str, after: int = 0) -> list[dict[str, Any]]:
        """The gateway's decisions about this VM's traffic, after event number `after`."""
        if self.egress is None:
            return []
        return await self.egress.gateway.audit(sandbox=vm_id, after=after)

    async def pause(self, vm_id: str) -> SandboxVM:
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            machine = _live(sb, "pause")
            try:
                await machine.pause()
            except VMStateError as e:
                raise WrongState(str(e), sb.state) from None
            return sb

    async def resume(self, vm_id: str) -> SandboxVM:
        """From paused: the vCPUs run again. From suspended: the snapshot is restored."""
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.machine is not None:
                try:
                    await sb.machine.resume()
                except VMStateError as e:
                    raise WrongState(str(e), sb.state) from None
                return sb
            snap_dir = self.suspended_dir / vm_id
            snap = SnapshotInfo.load(snap_dir)
            self._reserve(vm_id, sb.spec.vcpus, sb.spec.memory_mib)
            try:
                policy = self._policies.get(vm_id)
                async with self._network(vm_id, policy or Policy()) as tap_fd:
                    machine = await Machine.restore(
                        self.driver, self.pool, snap, vm_id=vm_id, hostname=sb.spec.hostname,
                        vms_dir=self.vms_dir, tap_fd=tap_fd,
                    )  # fmt: skip
                if policy is None and self.egress is not None:
                    self._stale.add(vm_id)  # suspended under an earlier worker process
                try:
                    sb.save(machine.run_dir)
                except BaseException:
                    await machine.close()
                    await self._detach(vm_id, keep_policy=True)
                    raise
            finally:
                del self._reserved[vm_id]
            sb.machine = machine
            # The VM now runs on its own copy of the disk; the snapshot has served.
            await asyncio.to_thread(shutil.rmtree, snap_dir, True)
            return sb

    async def suspend(self, vm_id: str) -> SandboxVM:
        """Memory, devices and disk saved to suspended/<id>; the VMM process ends."""
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.machine is None:
                return sb
            machine = _live(sb, "suspend")
            was_running = sb.state == "running"
            tmp = self.suspended_dir / f".{vm_id}.{uuid.uuid4().hex[:8]}"
            try:
                await machine.snapshot(tmp)
                sb.save(tmp)
                tmp.rename(self.suspended_dir / vm_id)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                if was_running and machine.status().state == VMState.PAUSED:
                    with contextlib.suppress(VMMError):
                        await machine.resume()
                raise
            await machine.close()
            sb.machine = None
            await self._detach(vm_id, keep_policy=True)  # a resume attaches it again
            return sb

    async def delete(self, vm_id: str) -> bool:
        """Stop the VM and remove its disk, snapshot and files; False if there was nothing.

        Its volumes are synced and unmounted first, so what was written to them stays."""
        _check_id(vm_id)
        async with self._locks.hold(vm_id):
            sb = self._vms.pop(vm_id, None)
            if sb is not None and sb.machine is not None:
                if sb.spec.volumes and sb.state in ("running", "paused"):
                    await _release_volumes(sb.machine, sb.spec.volumes)
                await sb.machine.close()
            found = sb is not None
            for leftover in (self.vms_dir / vm_id, self.suspended_dir / vm_id):
                if leftover.exists():
                    found = True
                    await _kill_leftover(leftover)
            await self._detach(vm_id)
            return found

    async def delete_volume(self, volume_id: str) -> bool:
        """Remove a volume's image; False if this worker has none."""
        if not VOLUME_ID.match(volume_id):
            raise InvalidArgument(f"volume id {volume_id!r} must match {VOLUME_ID.pattern}")
        users = [
            sb.id for sb in self._vms.values() if any(v.id == volume_id for v in sb.spec.volumes)
        ]
        if users:
            raise VolumeInUse(f"volume {volume_id} is attached to {', '.join(sorted(users))}")
        image = self.volumes_dir / f"{volume_id}.img"
        if not image.exists():
            return False
        image.unlink()
        return True

    async def reconcile(self, keep: Iterable[str]) -> list[str]:
        """Delete every VM and suspended snapshot not in `keep` (except very young VMs)."""
        wanted = set(keep)
        now = time.monotonic()
        ids = set(self._vms)
        ids.update(p.name for d in (self.vms_dir, self.suspended_dir) for p in d.iterdir()
                   if not p.name.startswith("."))  # fmt: skip
        removed: list[str] = []
        for vm_id in sorted(ids - wanted - set(self._reserved)):
            sb = self._vms.get(vm_id)
            if sb is not None and now - sb.since < self.reconcile_grace_s:
                continue
            if await self.delete(vm_id):
                removed.append(vm_id)
        return removed

    # --- the data plane ----------------------------------------------------------------------

    async def agent(self, vm_id: str) -> tuple[SandboxVM, AgentClient]:
        """The agent of a running VM (reconnected if its connection was lost)."""
        async with self._locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.state != "running":
                detail = f": {sb.reason}" if sb.reason else ""
                raise WrongState(f"VM {vm_id} is {sb.state}{detail}", sb.state)
            assert sb.machine is not None
            if not sb.machine.agent.connected:
                await sb.machine.reconnect(RECONNECT_TIMEOUT_S)
            return sb, sb.machine.agent

    async def exec(
        self,
        vm_id: str,
        cmd: str | list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        timeout: float | None = None,
        stdin: bool = False,
        pty: bool = False,
        rows: int = 24,
        cols: int = 80,
    ) -> ExecProcess:
        """Start a process; the sandbox's environment lies under the one given here."""
        sb, agent = await self.agent(vm_id)
        spec = sb.spec
        return await agent.exec(
            cmd, env={**spec.template_env, **spec.env, **(env or {})}, cwd=cwd or spec.workdir,
            user=user if user is not None else agent_user(spec.user), timeout=timeout,
            stdin=stdin, pty=pty, rows=rows, cols=cols,
        )  # fmt: skip


async def _start_service(machine: Machine, record: TemplateRecord) -> None:
    """Start the template's service (its start command, else the image's own command) and wait
    until its ready check passes, so every sandbox restored from the snapshot has it running."""
    start = record.start or (shlex.join(record.command) if record.command else None)
    how: dict[str, Any] = {"env": record.env, "cwd": record.workdir,
                           "user": agent_user(record.user)}  # fmt: skip
    if start:
        # Detached, with its output in a file: it outlives this exec and the snapshot.
        script = f"( {start} ) </dev/null >>{START_LOG} 2>&1 &"
        r = await machine.agent.run(["/bin/sh", "-c", script], timeout=30, **how)
        if r.exit_code != 0:
            raise VMManagerError(f"template {record.name}: start failed: {r.stderr.decode()}")
    if not record.ready:
        return
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        r = await machine.agent.run(["/bin/sh", "-c", record.ready], timeout=30, **how)
        if r.exit_code == 0:
            return
        if time.monotonic() > deadline:
            out = (r.stdout + r.stderr).decode(errors="replace").strip()[-500:]
            raise VMManagerError(
                f"template {record.name} was not ready after {READY_TIMEOUT_S:.0f} s "
                f"(ready check: exit {r.exit_code}: {out}; its start log is {START_LOG})"
            )
        await asyncio.sleep(0.2)


def _check_volumes(volumes: Sequence[VolumeMount]) -> None:
    if len(volumes) > VOLUME_SLOTS:
        raise InvalidArgument(f"at most {VOLUME_SLOTS} volumes per sandbox")
    paths = [os.path.normpath(v.path) for v in volumes]
    for v, path in zip(volumes, paths, strict=True):
        if not VOLUME_ID.match(v.id):
            raise InvalidArgument(f"volume id {v.id!r} must match {VOLUME_ID.pattern}")
        if not path.startswith("/") or path == "/":
            raise InvalidArgument(f"volume {v.id}: mount path {v.path!r} must be absolute, not /")
    if len(set(paths)) != len(paths) or len({v.id for v in volumes}) != len(volumes):
        raise InvalidArgument("each volume and each mount path may appear once")


async def _release_volumes(machine: Machine, volumes: Sequence[VolumeMount]) -> None:
    """Flush and unmount the volumes before the VM goes: best effort, the VM goes anyway."""
    try:
        if machine.status().state == VMState.PAUSED:
            await machine.resume()
        paths = [v.path for v in volumes]
        await machine.agent.run(["/bin/sh", "-c", 'sync; umount "$@"', "umount", *paths],
                                timeout=10)  # fmt: skip
    except (VMMError, AgentError, TimeoutError) as e:
        log.warning("VM %s: volumes not cleanly unmounted: %s", machine.id, e)


def _make_volume(image: Path, size_mib: int) -> None:
    """An empty ext4 volume, sparse; made under a temporary name so a crash leaves no half."""
    tmp = image.with_name(f".{image.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size_mib << 20)
        os.chmod(tmp, 0o600)
        r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(tmp)],
                           capture_output=True, text=True, check=False)  # fmt: skip
        if r.returncode != 0:
            raise VMManagerError(f"mkfs.ext4 of volume {image.stem} failed: {r.stderr.strip()}")
        tmp.rename(image)
    finally:
        tmp.unlink(missing_ok=True)


def _check_id(vm_id: str) -> None:
    if not VM_ID.match(vm_id):
        raise InvalidArgument(f"VM id {vm_id!r} must match {VM_ID.pattern}")


def _live(sb: SandboxVM, verb: str) -> Machine:
    if sb.machine is None or sb.state == "error":
        raise WrongState(f"cannot {verb} VM {sb.id}: it is {sb.state}", sb.state)
    return sb.machine


def _images_record(images: BootImages, nic: bool) -> dict[str, Any]:
    record: dict[str, Any] = {k: str(v) if v is not None else None
                              for k, v in asdict(images).items()}  # fmt: skip
    record["volume_slots"] = VOLUME_SLOTS  # the devices a restore must match
    record["nic"] = nic
    return record


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


async def _kill_leftover(directory: Path) -> None:
    """Kill whatever VMM still runs from `directory` (a run dir), then remove the directory."""
    for pid in vmm_pids(directory):
        try:
            proc = VMMProcess.adopt(pid, str(directory / QMP_SOCKET))
        except VMMError:
            continue  # gone meanwhile
        proc.kill()
        await proc.wait()
    await asyncio.to_thread(shutil.rmtree, directory, True)


def _mem_total_mib() -> int:
    return meminfo_mib("MemTotal") or 1024


def meminfo_mib(name: str) -> int | None:
    """A /proc/meminfo figure (MemTotal, MemAvailable, …) in MiB."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return int(line.split()[1]) // 1024
    return None

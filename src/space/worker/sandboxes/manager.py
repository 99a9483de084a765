"""One worker's sandboxes, keyed by sandbox id: the facade the worker API calls.

A create restores the base snapshot of its shape (`snapshots`), so it costs a restore, never a
boot; a VM whose VMM died is booted again from its own disk by the next create of it.
Suspending and resuming are `suspension`'s, checkpoints and rollbacks `checkpoints`', forks
`forks`'; adopting VMs after a worker restart and watching
them while they run are `recovery`'s; what the host can hold is `capacity`'s. Operations on one
sandbox are serialised by its lock; nothing here deletes a sandbox's disk except its delete.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from space import crashpoints
from space.gateway.client import GatewayError
from space.gateway.policy import Policy
from space.worker.agent_client import AgentClient, AgentError, ExecProcess
from space.worker.api.models import VM_ID
from space.worker.artifacts import Artifacts
from space.worker.artifacts import sandboxes as sandbox_artifacts
from space.worker.machine import DISK, BootImages, Machine
from space.worker.network import GUEST_MAC, Egress, NetworkError, SandboxNetwork
from space.worker.sandboxes import checkpoints, forks, guest, recovery, suspension
from space.worker.sandboxes.capacity import VCPU_OVERCOMMIT, Capacity, Claim
from space.worker.sandboxes.errors import (
    InvalidArgument,
    TemplateInUse,
    TemplateNotFound,
    VMManagerError,
    VMNotFound,
    WrongState,
)
from space.worker.sandboxes.records import (
    LOCK_FILE,
    SANDBOX_FILE,
    Layout,
    SandboxSpec,
    SandboxVM,
    VolumeMount,
)
from space.worker.sandboxes.snapshots import BaseSnapshots, KeyedLock, TakeOver
from space.worker.sandboxes.volumes import Volumes, check_volumes
from space.worker.storage.pool import Pool
from space.worker.templates import TemplateRecord, latest_templates, remove_template
from space.worker.templates.record import agent_user
from space.worker.vmm.base import Drive, Driver, VMMError, VMStateError

log = logging.getLogger(__name__)

RECONNECT_TIMEOUT_S = 10.0
# A delete waits this long for an operation in flight on its VM, then kills the VMM; the
# operation is cancelled if it still holds on at DELETE_TAKEOVER_S.
DELETE_GRACE_S = 2.0
DELETE_TAKEOVER_S = 6.0
RELEASE_S = 5.0  # for a guest to sync and unmount its volumes before its VM ends


@dataclass(frozen=True)
class ManagerOptions:
    capacity_vcpus: int | None = None
    capacity_memory_mib: int | None = None
    vcpu_overcommit: float = VCPU_OVERCOMMIT  # vCPUs admitted per host core
    admit_memory: Literal["measured", "guest"] = "measured"
    reserve_mib: int = 1024  # kept for template builds, the gateway and the worker itself
    reconcile_grace_s: float = 30.0  # a VM younger than this survives /reconcile
    base_snapshots: bool = True  # off: every create boots its VM
    images: Mapping[str, BootImages] = field(default_factory=dict)


class VMManager:
    def __init__(
        self,
        driver: Driver,
        pool: Pool,
        base_images: BootImages,
        worker_id: str,
        options: ManagerOptions | None = None,
        egress: Egress | None = None,
        artifacts: Artifacts | None = None,
    ) -> None:
        if not VM_ID.match(worker_id):
            raise ValueError(f"worker id {worker_id!r} must match {VM_ID.pattern}")
        opts = options or ManagerOptions()
        self.worker_id = worker_id
        self.driver = driver
        self.pool = pool
        self.options = opts
        self.reconcile_grace_s = opts.reconcile_grace_s  # a VM younger survives /reconcile
        self.templates: dict[str, BootImages] = {"base": base_images, **opts.images}
        self.records: dict[str, TemplateRecord] = {}  # built templates: how they run
        self.artifacts = artifacts  # the deployment's registry; None: all stays on this host
        self.layout = Layout(pool.root / "workers" / worker_id, pool.root)
        self.root = self.layout.root
        self.capacity = Capacity(
            pool.root, vcpus=opts.capacity_vcpus, memory_mib=opts.capacity_memory_mib,
            reserve_mib=opts.reserve_mib, vcpu_overcommit=opts.vcpu_overcommit,
            admit_memory=opts.admit_memory,
        )  # fmt: skip
        # Without egress VMs have no NIC at all; with it, each has a tap in a namespace of its
        # own whose traffic only the gateway's policy lets out.
        self.egress = egress
        self.volumes = Volumes(self.layout.volumes, self.layout.empty_slot)
        self.snapshots = BaseSnapshots(
            driver, pool, self.layout, self.volumes, self.build_network,
            self.egress.gateway.ca_pem if self.egress is not None else None, artifacts,
        )  # fmt: skip
        self._policies: dict[str, Policy] = {}  # in force, in memory only (they hold secrets)
        self._stale: set[str] = set()  # VMs whose policy died with the last worker process
        self._vms: dict[str, SandboxVM] = {}
        self.locks = KeyedLock()
        self._lock_fd: int | None = None

    # --- the worker's lifetime ---------------------------------------------------------------

    async def start(self) -> None:
        """Take the worker's lock, finish or undo what a previous process left half-done, and
        take over the VMs it left (see `recovery`)."""
        self.layout.make()
        self._take_lock()
        self.refresh_templates()
        self.volumes.clean()
        self.snapshots.clean()
        await checkpoints.clean(self)
        await recovery.adopt_all(self)
        if self.egress is not None:
            # Policies lived in the last worker's memory: adopted VMs get nothing out until the
            # control plane sends theirs again (it sees `policy: false` in /health).
            live = {sb.id: Policy() for sb in self._vms.values() if sb.machine is not None}
            for vm_id in await self.egress.start(live):
                log.warning("VM %s lost its network (rebuilt); its NIC no longer works", vm_id)
            self._stale = set(live)

    async def close(self, stop_vms: bool = False) -> None:
        """Let go of every VM: leave them running for the next worker process, or stop them.
        Suspended snapshots and the disks of crashed VMs stay on disk either way."""
        for sb in list(self._vms.values()):
            if sb.machine is None:
                continue
            if stop_vms:
                await sb.machine.vm.close()
            elif not sb.crashed:
                await sb.machine.detach()
        self._vms.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

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

    def refresh_templates(self) -> None:
        """Make the newest build of every template built in the pool usable (and forget
        those whose builds are gone)."""
        latest = latest_templates(self.pool.root)
        for name in set(self.records) - set(latest):
            del self.templates[name], self.records[name]
        for name, record in latest.items():
            if name != "base":  # the platform's own, from `space image base`
                self.use_template(record)

    def use_template(self, record: TemplateRecord) -> None:
        """Sandboxes of `record.name` are made of this build from now on."""
        base = self.templates["base"]
        self.templates[record.name] = BootImages(base.kernel, base.initrd, record.rootfs)
        self.records[record.name] = record

    async def remove_template(self, name: str) -> bool:
        """Delete a built template, its base snapshots and every build of it."""
        if name == "base" or name not in self.records:
            return False
        users = sorted(sb.id for sb in self._vms.values() if sb.spec.template == name)
        if users:
            raise TemplateInUse(f"template {name} is used by {', '.join(users)}")
        await self.snapshots.remove_template(name)
        await asyncio.to_thread(remove_template, self.pool.root, name)
        del self.templates[name], self.records[name]
        return True

    # --- queries -----------------------------------------------------------------------------

    def vms(self) -> list[SandboxVM]:
        return sorted(self._vms.values(), key=lambda sb: sb.id)

    def get(self, vm_id: str) -> SandboxVM:
        sb = self._vms.get(vm_id)
        if sb is None:
            raise VMNotFound(f"no VM {vm_id!r} on worker {self.worker_id}")
        return sb

    def has(self, vm_id: str) -> bool:
        return vm_id in self._vms or (self.layout.vms / vm_id).exists()

    def held(self, but: str | None = None) -> list[Claim]:
        """What every sandbox here (but one) holds: live ones their VM (as measured), suspended
        ones the room their resume needs, crashed ones their reboot's; with what their disks
        may grow by."""
        measured = self.capacity.pss_mib
        return [
            Claim(sb.spec.vcpus, sb.spec.memory_mib, _growth_mib(sb, self.layout),
                  measured.get(sb.id) if sb.machine is not None else None)
            for sb in self._vms.values()
            if sb.id != but
        ]  # fmt: skip

    def adopt_record(self, sb: SandboxVM) -> None:
        """A sandbox found on disk at start, or restored under its id (recovery, suspension)."""
        self._vms[sb.id] = sb

    def forget(self, vm_id: str) -> SandboxVM | None:
        return self._vms.pop(vm_id, None)

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
        """A running VM restored from the base snapshot of its shape; the existing one if any
        (booted again from its disk if its VMM died). `warm` runs the platform's own `true`
        before answering (warm-pool members, see `guest.warm`)."""
        _check_id(vm_id)
        async with self.locks.hold(vm_id):
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
                if sb.crashed:
                    await self._reboot(sb, policy)
                return sb
            images = self._images(template)
            image_mib = images.rootfs.stat().st_size >> 20
            if disk_mib and disk_mib < image_mib:
                raise InvalidArgument(
                    f"disk_mib {disk_mib} is smaller than template {template} ({image_mib} MiB)"
                )
            record = self.records.get(template)
            if record is not None and (why := record.shape_error(vcpus, memory_mib)):
                raise InvalidArgument(why)
            check_volumes(volumes)
            self.volumes.check_writers(vm_id, volumes, self._vms.values())
            spec = SandboxSpec(
                template, vcpus, memory_mib, dict(env or {}), hostname or f"sb-{vm_id}",
                disk_mib, tuple(volumes),
                template_env={**(guest.CA_ENV if self.egress else {}),
                              **(record.env if record else {})},
                workdir=record.workdir if record else None,
                user=record.user if record else None,
            )  # fmt: skip
            held = self.held()
            self.capacity.check_disk(
                max(disk_mib, image_mib) + sum(v.size_mib for v in volumes),
                sum(c.disk_mib for c in held) + self.volumes.growth_mib(),
            )
            self.capacity.reserve(vm_id, Claim(vcpus, memory_mib), held)
            try:
                sb = await self._create(vm_id, spec, images, policy, warm)
            finally:
                self.capacity.release(vm_id)
            self._vms[vm_id] = sb
            log.info("VM %s created (%s) in %.0f ms", vm_id, sb.boot, sb.took_ms)
            return sb

    async def _create(
        self, vm_id: str, spec: SandboxSpec, images: BootImages, policy: Policy | None,
        warm: bool,
    ) -> SandboxVM:  # fmt: skip
        started = time.perf_counter()
        async with self.network(vm_id, policy or Policy()) as tap_fd:
            crashpoints.reached("create.after-network")
            machine, boot = await self._make(vm_id, spec, images, tap_fd)
        crashpoints.reached("create.after-vmm")
        sb = SandboxVM(vm_id, spec, machine, boot, (time.perf_counter() - started) * 1000)
        try:
            await self._set_up(machine, spec)
            if warm:
                await guest.warm(machine, env=spec.template_env, cwd=spec.workdir,
                                 user=agent_user(spec.user))  # fmt: skip
            crashpoints.reached("create.before-record")
            sb.save(machine.run_dir)
        except BaseException:
            await machine.close()
            await self.detach(vm_id)
            raise
        return sb

    async def _set_up(self, machine: Machine, spec: SandboxSpec) -> None:
        if spec.volumes:
            await guest.mount_volumes(machine, spec.volumes)
        if spec.disk_mib:
            try:
                await machine.grow_disk(spec.disk_mib)
            except ValueError as e:
                raise InvalidArgument(str(e)) from None

    async def _reboot(self, sb: SandboxVM, policy: Policy | None) -> None:
        """Boot a sandbox whose VMM died again, on its own disk: its files are kept, its
        processes are not."""
        run_dir = self.layout.vms / sb.id
        if not (run_dir / DISK).exists():
            raise WrongState(f"VM {sb.id} lost its disk: it cannot be booted again", "error")
        spec = sb.spec
        images = self._images(spec.template)
        if sb.machine is not None:
            await sb.machine.agent.close()
        started = time.perf_counter()
        drives = await self.volumes.drives(spec.volumes)
        async with self.network(sb.id, policy or self._policies.get(sb.id) or Policy()) as tap:
            machine = await Machine.reboot(
                self.driver, images, run_dir, vm_id=sb.id, vcpus=spec.vcpus,
                memory_mib=spec.memory_mib, hostname=spec.hostname, drives=drives, tap_fd=tap,
                guest_mac=GUEST_MAC if tap is not None else None, keep=[SANDBOX_FILE],
            )  # fmt: skip
        try:
            # The CA is on its disk already; volumes and the template's service are not up.
            if spec.volumes:
                await guest.mount_volumes(machine, spec.volumes)
            record = self.records.get(spec.template)
            if record is not None:
                await guest.start_service(machine, record)
        except BaseException:
            await machine.vm.close()  # the disk stays: the sandbox is still crashed
            raise
        sb.machine, sb.condition, sb.why = machine, "live", None
        sb.boot, sb.reboots = "reboot", sb.reboots + 1
        sb.took_ms = (time.perf_counter() - started) * 1000
        sb.save(run_dir)
        log.warning("VM %s booted again from its disk (reboot %d)", sb.id, sb.reboots)

    def _images(self, template: str) -> BootImages:
        images = self.templates.get(template)
        if images is None:
            known = ", ".join(sorted(self.templates))
            raise TemplateNotFound(f"no template {template!r} on this worker (it has {known})")
        return images

    async def _make(
        self, vm_id: str, spec: SandboxSpec, images: BootImages, tap_fd: int | None
    ) -> tuple[Machine, str]:
        """The sandbox's VM and how it was made: restored from the base snapshot of its shape
        ("restore"; "cold" if that snapshot had to be built first), or booted ("cold")."""
        drives = await self.volumes.drives(spec.volumes)
        if self.options.base_snapshots:
            restored = await self._restore_base(vm_id, spec, images, drives, tap_fd)
            if restored is not None:
                return restored
        machine = await Machine.boot(
            self.driver, self.pool, images, vm_id=vm_id, vcpus=spec.vcpus,
            memory_mib=spec.memory_mib, hostname=spec.hostname, vms_dir=self.layout.vms,
            drives=drives, tap_fd=tap_fd, guest_mac=GUEST_MAC if tap_fd is not None else None,
        )  # fmt: skip
        if tap_fd is not None:
            assert self.egress is not None
            await guest.install_ca(machine, await self.egress.gateway.ca_pem())
        return machine, "cold"

    async def _restore_base(
        self, vm_id: str, spec: SandboxSpec, images: BootImages, drives: tuple[Drive, ...],
        tap_fd: int | None,
    ) -> tuple[Machine, str] | None:  # fmt: skip
        """The VM restored from the base snapshot of its shape (built first if need be); None
        where it must boot instead."""
        record = self.records.get(spec.template)
        try:
            base, built = await self.snapshots.get(
                spec.template, spec.vcpus, spec.memory_mib, images, record
            )
        except (VMMError, AgentError, TimeoutError) as e:
            if record is None or record.snapshot is None:
                raise
            # A template made of a checkpoint whose memory no longer loads (another kernel,
            # another QEMU) still has its files: its sandboxes boot from them.
            log.warning("no base snapshot of %s, booting instead: %s", spec.template, e)
            return None
        try:
            machine = await Machine.restore(
                self.driver, self.pool, base, vm_id=vm_id, hostname=spec.hostname,
                vms_dir=self.layout.vms, drives=drives, tap_fd=tap_fd,
            )  # fmt: skip
        except (VMMError, AgentError, TimeoutError) as e:
            # A snapshot that no longer restores (e.g. a QEMU upgrade) must not stop creates:
            # this one boots, and the next one builds the base again.
            log.warning("base snapshot %s failed to restore, booting instead: %s", base.path, e)
            self.snapshots.drop(base.path)
            return None
        return machine, "cold" if built else "restore"

    async def claim(
        self, vm_id: str, env: Mapping[str, str], policy: Policy | None = None
    ) -> SandboxVM:
        """Hand a warm-pool VM to the tenant that claimed it: their environment and egress
        policy, and a fresh clock, RNG state and agent token (it may have waited long)."""
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            machine = sb.live_machine("claim")
            if sb.state != "running":
                raise WrongState(f"cannot claim VM {vm_id}: it is {sb.state}", sb.state)
            if not machine.agent.connected:
                await machine.reconnect(RECONNECT_TIMEOUT_S)
            if policy is not None:
                await self._set_policy(vm_id, policy)
            await machine.renew_identity()
            crashpoints.reached("claim.after-identity")
            sb.spec = replace(sb.spec, env=dict(env))
            sb.save(machine.run_dir)
            return sb

    async def pause(self, vm_id: str) -> SandboxVM:
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            try:
                await sb.live_machine("pause").pause()
            except VMStateError as e:
                raise WrongState(str(e), sb.state) from None
            return sb

    async def resume(self, vm_id: str) -> SandboxVM:
        """From paused: the vCPUs run again. From suspended: the snapshot is restored."""
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.condition == "suspended":
                try:
                    return await suspension.resume(self, sb)
                except BaseException:
                    self._policies.pop(vm_id, None)  # its secrets leave with the failed resume
                    raise
            try:
                await sb.live_machine("resume").resume()
            except VMStateError as e:
                raise WrongState(str(e), sb.state) from None
            return sb

    async def suspend(self, vm_id: str) -> SandboxVM:
        """Memory, devices and disk saved to suspended/<id>; the VMM process ends. With a
        registry, the snapshot is pushed too (`sb.artifact`), so any worker can resume it."""
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.condition != "suspended":
                await suspension.suspend(self, sb)
            if sb.artifact is None:
                sb.artifact = await sandbox_artifacts.push(self, sb)
            return sb

    async def adopt(self, vm_id: str, artifact: str) -> SandboxVM:
        """A sandbox suspended on another worker, pulled from the registry: suspended here."""
        return await sandbox_artifacts.adopt(self, vm_id, artifact)

    async def checkpoint(self, vm_id: str, checkpoint_id: str) -> checkpoints.Taken:
        """Memory, devices and disk of a running VM, saved while it runs on (a short pause)."""
        _check_id(checkpoint_id)
        async with self.locks.hold(vm_id):
            return await checkpoints.take(self, self.get(vm_id), checkpoint_id)

    async def delete_checkpoint(self, vm_id: str, checkpoint_id: str) -> bool:
        _check_id(checkpoint_id)
        async with self.locks.hold(vm_id):
            return await checkpoints.remove(self, vm_id, checkpoint_id)

    async def rollback(self, vm_id: str, checkpoint_id: str) -> SandboxVM:
        """The VM as it was at a checkpoint of its own, in place: same id, its processes and
        files as they were then."""
        _check_id(checkpoint_id)
        async with self.locks.hold(vm_id):
            return await checkpoints.rollback(self, self.get(vm_id), checkpoint_id)

    async def fork(
        self, vm_id: str, children: Sequence[forks.Child], checkpoint_id: str | None = None
    ) -> tuple[list[SandboxVM], float]:
        """Running children of a VM's state now (or of one of its checkpoints)."""
        for child in children:
            _check_id(child.id)
        if checkpoint_id is not None:
            _check_id(checkpoint_id)
        async with self.locks.hold(vm_id):
            return await forks.fork(self, self.get(vm_id), children, checkpoint_id)

    async def delete(self, vm_id: str) -> bool:
        """Stop the VM and remove its disk, snapshot, checkpoints and files; False if there was
        nothing.
        Its volumes are synced and unmounted first, so what was written to them stays.

        A delete never waits long for another operation on the VM (a suspend of a VMM that
        stopped answering, a guest that never answers): after DELETE_GRACE_S its VMM is killed,
        which fails that operation at once, and after DELETE_TAKEOVER_S it is cancelled."""
        _check_id(vm_id)

        async def end_vmm() -> None:
            sb = self._vms.get(vm_id)
            if sb is not None and sb.machine is not None:
                await sb.machine.vm.kill()

        take_over = TakeOver(DELETE_GRACE_S, DELETE_TAKEOVER_S, end_vmm)
        async with self.locks.hold(vm_id, take_over):
            sb = self._vms.pop(vm_id, None)
            if sb is not None and sb.machine is not None:
                if sb.spec.volumes and sb.state in ("running", "paused"):
                    try:
                        await asyncio.wait_for(
                            guest.release_volumes(sb.machine, sb.spec.volumes), RELEASE_S
                        )
                    except TimeoutError:
                        log.warning("VM %s: its volumes were not released within %.0f s; "
                                    "ending it all the same", vm_id, RELEASE_S)  # fmt: skip
                with contextlib.suppress(AgentError):
                    await sb.machine.agent.close()
                await sb.machine.vm.close()
            crashpoints.reached("delete.after-stop")
            found = sb is not None
            for leftover in (self.layout.vms / vm_id, self.layout.suspended / vm_id):
                if leftover.exists():
                    found = True
                    await recovery.kill_leftover(leftover)
            if checkpoints.directory(self, vm_id).exists():
                found = True
                await checkpoints.remove_all(self, vm_id)
            crashpoints.reached("delete.after-files")
            await self.detach(vm_id)
            return found

    async def delete_volume(self, volume_id: str) -> bool:
        return self.volumes.delete(volume_id, self._vms.values())

    async def reconcile(self, keep: Iterable[str]) -> list[str]:
        """Delete every VM and suspended snapshot not in `keep` (except very young VMs)."""
        wanted = set(keep)
        now = time.monotonic()
        ids = set(self._vms)
        ids.update(p.name for d in (self.layout.vms, self.layout.suspended,
                                    self.layout.checkpoints)
                   for p in d.iterdir() if not p.name.startswith("."))  # fmt: skip
        removed: list[str] = []
        for vm_id in sorted(ids - wanted - self.capacity.reserved()):
            sb = self._vms.get(vm_id)
            if sb is not None and now - sb.since < self.reconcile_grace_s:
                continue
            if await self.delete(vm_id):
                removed.append(vm_id)
        return removed

    # --- network ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def network(self, vm_id: str, policy: Policy) -> AsyncIterator[int | None]:
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
            await self.detach(vm_id)
            raise
        finally:
            os.close(fd)

    @contextlib.asynccontextmanager
    async def build_network(self, vm_id: str, policy: Policy) -> AsyncIterator[int | None]:
        """A network for a VM of the worker's own (a base snapshot's), removed at the end."""
        try:
            async with self.network(vm_id, policy) as fd:
                yield fd
        finally:
            await self.detach(vm_id)

    async def detach(self, vm_id: str, keep_policy: bool = False) -> None:
        if self.egress is None:
            return
        if not keep_policy:
            self._policies.pop(vm_id, None)
            self._stale.discard(vm_id)
        try:
            await self.egress.detach(vm_id)
        except (GatewayError, NetworkError) as e:
            log.warning("network of %s not fully removed: %s", vm_id, e)

    def network_of(self, vm_id: str) -> SandboxNetwork | None:
        return self.egress.network(vm_id) if self.egress is not None else None

    def policy(self, vm_id: str) -> Policy | None:
        return self._policies.get(vm_id)

    def policies(self) -> dict[str, Policy]:
        """The policies in force of every VM that has a network now."""
        return {sb.id: self._policies.get(sb.id, Policy()) for sb in self._vms.values()
                if sb.machine is not None and not sb.crashed}  # fmt: skip

    async def set_policy(self, vm_id: str, policy: Policy) -> None:
        """A new egress policy for a VM, in force at once."""
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.machine is None or sb.crashed:
                self._policies[vm_id] = policy  # in force when it runs again
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

    def mark_stale(self, vm_id: str) -> None:
        self._stale.add(vm_id)

    async def audit(self, vm_id: str, after: int = 0) -> list[dict[str, Any]]:
        """The gateway's decisions about this VM's traffic, after event number `after`."""
        if self.egress is None:
            return []
        return await self.egress.gateway.audit(sandbox=vm_id, after=after)

    # --- the data plane ----------------------------------------------------------------------

    async def agent(self, vm_id: str) -> tuple[SandboxVM, AgentClient]:
        """The agent of a running VM (reconnected if its connection was lost)."""
        async with self.locks.hold(vm_id):
            sb = self.get(vm_id)
            if sb.state != "running":
                detail = f": {sb.reason}" if sb.reason else ""
                raise WrongState(f"VM {vm_id} is {sb.state}{detail}", sb.state)
            assert sb.machine is not None
            if not sb.machine.agent.connected:
                await sb.machine.reconnect(RECONNECT_TIMEOUT_S)
            return sb, sb.machine.agent

    async def exec(self, vm_id: str, cmd: str | list[str], **options: Any) -> ExecProcess:
        """Start a process and follow it; `options` as `AgentClient.exec` takes them, the
        sandbox's environment, directory and user under those given."""
        agent, options = await self._in_sandbox(vm_id, options)
        return await agent.exec(cmd, **options)

    async def start_process(
        self, vm_id: str, cmd: str | list[str], **options: Any
    ) -> dict[str, Any]:
        """Start a background process and leave it running: its entry in the agent's list."""
        agent, options = await self._in_sandbox(vm_id, options)
        return await agent.start(cmd, **options)

    async def _in_sandbox(
        self, vm_id: str, options: dict[str, Any]
    ) -> tuple[AgentClient, dict[str, Any]]:
        sb, agent = await self.agent(vm_id)
        spec = sb.spec
        env = {**spec.template_env, **spec.env, **(options.get("env") or {})}
        user = options.get("user")
        return agent, {
            **options, "env": env, "cwd": options.get("cwd") or spec.workdir,
            "user": user if user is not None else agent_user(spec.user),
        }  # fmt: skip


def _check_id(vm_id: str) -> None:
    if not VM_ID.match(vm_id):
        raise InvalidArgument(f"VM id {vm_id!r} must match {VM_ID.pattern}")


def _growth_mib(sb: SandboxVM, layout: Layout) -> int:
    """What a sandbox's disk may still grow by: its size less what it holds now."""
    directory = layout.suspended / sb.id if sb.condition == "suspended" else layout.vms / sb.id
    with contextlib.suppress(OSError):
        st = (directory / DISK).stat()
        return max(0, st.st_size - st.st_blocks * 512) >> 20
    return 0

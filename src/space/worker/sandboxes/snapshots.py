"""Base snapshots: one per (template, vCPUs, memory) shape, which every create of that shape
restores instead of booting.

The first create of a shape boots a VM under `building/`, sets it up as every sandbox of the
template starts (the gateway's CA, the template's service), snapshots it into a hidden
directory of `base/`, writes down what it was made from and renames it into place: a crash
leaves no half-made snapshot that a restore could pick up. A template made from a checkpoint
has one shape, the checkpoint's: its base snapshot is that checkpoint saved again with its
memory as a file to map (`machine.remap`), already set up, its processes as they were.

With a registry, a base snapshot is shared between workers: one that has to make it pushes it
once made, tagged by everything it depends on (the template's build, the guest kernel, the
devices, the gateway's CA in it); another that lacks it pulls that before it would boot one,
and trusts it as any snapshot from another host (`artifacts.sandboxes.foreign_snapshot_problem`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from space.gateway.policy import Policy
from space.worker.api.models import VOLUME_SLOTS
from space.worker.artifacts import Artifacts
from space.worker.artifacts.trust import foreign_snapshot_problem
from space.worker.machine import BootImages, Machine, remap
from space.worker.network import GUEST_MAC
from space.worker.sandboxes import guest
from space.worker.sandboxes.errors import Unavailable
from space.worker.sandboxes.records import (
    UNREADABLE,
    Layout,
    fsync_tree,
    rename_durable,
    write_durable,
)
from space.worker.sandboxes.volumes import Volumes
from space.worker.storage.pool import Pool
from space.worker.storage.reflink import clone_file
from space.worker.templates import TemplateRecord
from space.worker.templates.errors import ImageError, RegistryError
from space.worker.vmm.base import Driver, SnapshotInfo, VMMError
from space.worker.vmm.qemu import host_tsc_khz

log = logging.getLogger(__name__)

IMAGES_FILE = "images.json"
TAG_FILE = "tag"  # of a base snapshot pulled from the registry: what it was shared as
KIND = "snapshot"
PULL_S = 120.0  # on the way of a create: a registry slower than this, and it is made here
NetworkFor = Callable[[str, Policy], AbstractAsyncContextManager[int | None]]


@dataclass(frozen=True)
class TakeOver:
    """How a caller that must not wait gets a key's lock from its holder: after `grace` s,
    `interrupt()` (which makes the holder's calls fail at once, e.g. by ending its VMM); after
    `bound` s in all, the holder's task is cancelled."""

    grace: float
    bound: float
    interrupt: Callable[[], Awaitable[None]]


class KeyedLock:
    """One asyncio.Lock per key, dropped once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._holders: dict[str, asyncio.Task[Any]] = {}

    @contextlib.asynccontextmanager
    async def hold(
        self, key: str, take_over: TakeOver | None = None, cancellable: bool = True
    ) -> AsyncIterator[None]:
        """Hold `key`'s lock. A `take_over` gets it from a holder that keeps it too long; a
        holder whose task must live on (a loop's) is never cancelled for it (`cancellable`)."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            if take_over is None:
                await lock.acquire()
            else:
                await self._take_over(key, lock, take_over)
            if cancellable and (task := asyncio.current_task()):
                self._holders[key] = task
            try:
                yield
            finally:
                self._holders.pop(key, None)
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)

    async def _take_over(self, key: str, lock: asyncio.Lock, how: TakeOver) -> None:
        acquired = asyncio.ensure_future(lock.acquire())
        try:
            done, _ = await asyncio.wait({acquired}, timeout=how.grace)
            if not done:
                log.warning("%s: its holder kept it %.0f s; interrupting it", key, how.grace)
                # In the background: ending a VMM stuck in the kernel may itself not end.
                interrupt = asyncio.ensure_future(how.interrupt())
                interrupt.add_done_callback(_log_failure(key))
                done, _ = await asyncio.wait({acquired}, timeout=how.bound - how.grace)
            if not done and (holder := self._holders.get(key)) is not None:
                log.warning("%s: its holder kept it %.0f s; cancelling it", key, how.bound)
                holder.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(acquired), how.bound)
            except TimeoutError:
                raise Unavailable(f"{key} is held by an operation that does not end") from None
        except BaseException:
            if acquired.done() and not acquired.cancelled() and acquired.exception() is None:
                lock.release()
            acquired.cancel()
            raise


def _log_failure(key: str) -> Callable[[asyncio.Future[None]], None]:
    def done(task: asyncio.Future[None]) -> None:
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("%s: interrupting its holder failed: %r", key, e)

    return done


class BaseSnapshots:
    def __init__(
        self,
        driver: Driver,
        pool: Pool,
        layout: Layout,
        volumes: Volumes,
        network: NetworkFor,
        ca_pem: Callable[[], Awaitable[bytes]] | None,
        artifacts: Artifacts | None = None,
    ) -> None:
        self.driver = driver
        self.pool = pool
        self.layout = layout
        self.volumes = volumes
        self.network = network  # the network a build VM gets (a NIC when sandboxes have one)
        self.ca_pem = ca_pem  # None when VMs have no network
        self.artifacts = artifacts
        self._locks = KeyedLock()
        self._pushes: set[asyncio.Task[None]] = set()
        self._refused: set[str] = set()  # tags pulled that did not restore here: made here

    def clean(self) -> None:
        for tmp in self.layout.base.glob(".*"):
            shutil.rmtree(tmp, ignore_errors=True)

    def drop(self, path: Path) -> None:
        """Forget a base snapshot that failed to restore: the next create builds it again
        (one pulled is not pulled again)."""
        with contextlib.suppress(OSError):
            self._refused.add((path / TAG_FILE).read_text())
        shutil.rmtree(path, ignore_errors=True)

    async def remove_template(self, name: str) -> None:
        for snap in self.layout.base.iterdir():
            if snap.name.rsplit("-", 2)[0] == name:
                await asyncio.to_thread(shutil.rmtree, snap, True)

    async def get(
        self, template: str, vcpus: int, memory_mib: int, images: BootImages,
        record: TemplateRecord | None,
    ) -> tuple[SnapshotInfo, bool]:  # fmt: skip
        """The base snapshot for this shape, and whether it had to be built just now."""
        key = f"{template}-{vcpus}-{memory_mib}"
        path = self.layout.base / key
        made_from = _images_record(images, nic=self.ca_pem is not None, driver=self.driver)
        async with self._locks.hold(key):
            with contextlib.suppress(OSError, ValueError, VMMError):
                if json.loads((path / IMAGES_FILE).read_text()) == made_from:
                    return SnapshotInfo.load(path), False
                log.info("base snapshot %s was made from other images; rebuilding it", key)
            tag = await self._tag(images, record, made_from) if self.artifacts else ""
            if tag and (pulled := await self._pull(key, tag, images, made_from)) is not None:
                return pulled, False
            started = time.perf_counter()
            build_id = f"base-{key}-{uuid.uuid4().hex[:6]}"
            tmp = self.staging(key)
            try:
                await self._take(tmp, build_id, vcpus, memory_mib, images, record)
                await self._install(path, tmp, made_from)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("base snapshot %s built in %.1f s", key, time.perf_counter() - started)
            if tag:
                await self._push(key, tag, path)
            return SnapshotInfo.load(path), True

    async def put(
        self, template: str, vcpus: int, memory_mib: int, images: BootImages, made: Path
    ) -> SnapshotInfo:
        """Make `made`, a snapshot made elsewhere in the base directory (hidden), the base
        snapshot of this shape, as a build of it would be."""
        key = f"{template}-{vcpus}-{memory_mib}"
        made_from = _images_record(images, nic=self.ca_pem is not None, driver=self.driver)
        async with self._locks.hold(key):
            await self._install(self.layout.base / key, made, made_from)
        return SnapshotInfo.load(self.layout.base / key)

    async def _tag(
        self, images: BootImages, record: TemplateRecord | None, made_from: dict[str, Any]
    ) -> str:
        """What a shared base snapshot of this shape must have been made from, as a tag: the
        same on every worker that could use it (not the pool's own paths)."""
        ca = hashlib.sha256(await self.ca_pem()).hexdigest() if self.ca_pem else None
        build = record.digest if record is not None else images.rootfs.parent.name
        shared = {k: v for k, v in made_from.items() if k != "rootfs"}
        text = json.dumps({"build": build, "ca": ca, "host": _host_key(self.driver), **shared},
                          sort_keys=True)  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    async def _pull(
        self, key: str, tag: str, images: BootImages, made_from: dict[str, Any]
    ) -> SnapshotInfo | None:
        """The base snapshot another worker made and pushed, installed here; None if there is
        none to trust, or the registry does not answer in time (the caller then makes one)."""
        if self.artifacts is None or tag in self._refused:
            return None
        dest = self.staging(key)
        try:
            async with asyncio.timeout(PULL_S):
                reference = await self.artifacts.find(KIND, key, tag)
                if reference is None:
                    return None
                await self.artifacts.pull(reference, KIND, key, dest, log.info)
            if why := foreign_snapshot_problem(images, SnapshotInfo.load(dest)):
                raise ImageError(why)
            write_durable(dest / TAG_FILE, tag)
            await self._install(self.layout.base / key, dest, made_from)
        except (RegistryError, ImageError, OSError, VMMError, TimeoutError, *UNREADABLE) as e:
            log.warning("base snapshot %s not taken from the registry (made here): %s", key, e)
            self._refused.add(tag)
            return None
        finally:
            shutil.rmtree(dest, ignore_errors=True)  # gone once installed
        log.info("base snapshot %s pulled from %s", key, reference)
        return SnapshotInfo.load(self.layout.base / key)

    async def _push(self, key: str, tag: str, path: Path) -> None:
        """Share a base snapshot made here, in the background from a reflinked copy of it
        (the snapshot itself may be rebuilt or dropped meanwhile): the create that made it does
        not wait; a failure only means the next worker makes its own."""
        if self.artifacts is None:
            return
        copy = self.staging(f"push-{key}")
        await asyncio.to_thread(shutil.copytree, path, copy, copy_function=_clone)

        async def push(artifacts: Artifacts) -> None:
            try:
                await artifacts.push(KIND, key, tag, copy, {"key": key}, log.info)
            except (RegistryError, OSError) as e:
                log.warning("base snapshot %s not pushed: %s", key, e)
            finally:
                await asyncio.to_thread(shutil.rmtree, copy, True)

        task = asyncio.ensure_future(push(self.artifacts))
        self._pushes.add(task)
        task.add_done_callback(self._pushes.discard)

    def staging(self, name: str) -> Path:
        """Where a base snapshot is made: hidden in the base directory, removed at start."""
        return self.layout.base / f".{name}.{uuid.uuid4().hex[:8]}"

    async def remap(self, snapshot: SnapshotInfo, dest: Path, vm_id: str) -> SnapshotInfo:
        """`machine.remap` of a snapshot of this worker's VMs, with a network of its own."""
        async with self.network(vm_id, Policy()) as tap_fd:
            return await remap(self.driver, snapshot, dest, vm_id=vm_id,
                               vms_dir=self.layout.building,
                               drives=await self.volumes.drives(()), tap_fd=tap_fd)  # fmt: skip

    async def _install(self, path: Path, made: Path, made_from: dict[str, Any]) -> None:
        """`made` in place as the base snapshot `path`, with what it was made from (under the
        lock of its key)."""
        write_durable(made / IMAGES_FILE, json.dumps(made_from))
        await asyncio.to_thread(fsync_tree, made)
        shutil.rmtree(path, ignore_errors=True)
        rename_durable(made, path)

    async def _take(
        self, dest: Path, build_id: str, vcpus: int, memory_mib: int, images: BootImages,
        record: TemplateRecord | None,
    ) -> None:  # fmt: skip
        """Boot a VM, set it up and snapshot it; or, for a template made of a checkpoint, save
        that checkpoint again with its memory as a file (its processes as they were)."""
        checkpoint = record.snapshot_path if record is not None else None
        if checkpoint is not None:
            # Of the checkpoint's own shape: the manager refuses creates of any other.
            await self.remap(SnapshotInfo.load(checkpoint), dest, build_id)
            return
        # A NIC too when sandboxes get one (a restore needs the same devices); no egress.
        async with (
            self.network(build_id, Policy()) as tap_fd,
            await Machine.boot(
                self.driver, self.pool, images, vm_id=build_id, vcpus=vcpus,
                memory_mib=memory_mib, vms_dir=self.layout.building,
                drives=await self.volumes.drives(()), tap_fd=tap_fd,
                guest_mac=GUEST_MAC if tap_fd is not None else None, snapshot_source=True,
            ) as machine,
        ):  # fmt: skip
            await self._set_up(machine, record)
            await machine.snapshot(dest)

    async def _set_up(self, machine: Machine, record: TemplateRecord | None) -> None:
        """As every sandbox of the template starts: the gateway's CA, the template's service;
        then what first commands read, into the page cache the snapshot keeps."""
        if self.ca_pem is not None:
            await guest.install_ca(machine, await self.ca_pem())
        if record is not None:
            await guest.start_service(machine, record)
        await guest.warm(machine, **guest.runs_as(record))


def _clone(src: str, dst: str) -> None:
    clone_file(Path(src), Path(dst))


@functools.cache
def _host_key(driver: Driver) -> str:
    """What a snapshot's guest state depends on beyond its images: the VMM (its binary), how it
    runs guests, and the CPU it passes through (features, and the TSC rate TCG guests get)."""
    parts = [type(driver).__name__, str(getattr(driver, "accel", "")), str(host_tsc_khz())]
    binary = shutil.which(str(getattr(driver, "binary", "")) or "qemu-system-x86_64")
    if binary:
        st = os.stat(binary)
        parts.append(f"{binary}:{st.st_size}:{st.st_mtime_ns}")
    with contextlib.suppress(OSError):
        cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
        parts += [line for line in cpu.splitlines()
                  if line.startswith(("model name", "flags"))]  # fmt: skip
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _images_record(images: BootImages, nic: bool, driver: Driver) -> dict[str, Any]:
    record: dict[str, Any] = {k: str(v) if v is not None else None
                              for k, v in asdict(images).items()}  # fmt: skip
    record["volume_slots"] = VOLUME_SLOTS  # the devices a restore must match
    record["nic"] = nic
    record["free_page_reporting"] = driver.free_page_reporting
    record["mapped_memory"] = driver.mapped_memory
    return record

"""Taking over a previous worker process's VMs, and watching VMs while they run.

At start (`adopt_all`), every run directory is one of:
- a VM whose VMM still runs: adopted (its agent answers) or, if it does not answer in time,
  kept as `unresponsive` and tried again every few seconds, never killed for it;
- a VM whose VMM is gone: `crashed`, its disk kept, so the next create boots it again from it;
- a create that never finished (no sandbox.json) or a sandbox that was suspended meanwhile
  (its snapshot in `suspended/` wins; that VM has been paused since it was taken): removed.

While the worker runs (`Watch`), every VMM is asked its state with a short deadline: one that
does not answer is `unresponsive` until it does; one QEMU stopped on a write error (a full
pool) is reported, and continued once the pool has room again; guests see their disks full
meanwhile (`fullpool.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from space.worker.agent_client import AgentClient, AgentError
from space.worker.machine import DISK, Machine
from space.worker.sandboxes import suspension
from space.worker.sandboxes.capacity import FULL_MIB
from space.worker.sandboxes.fullpool import FullPool
from space.worker.sandboxes.records import SANDBOX_FILE, UNREADABLE, SandboxVM
from space.worker.vmm.base import VMMError, VMState
from space.worker.vmm.process import VMMProcess, vmm_pids

if TYPE_CHECKING:
    from space.worker.sandboxes.manager import VMManager

log = logging.getLogger(__name__)

ADOPT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 2.0
WATCH_S = 1.0
RETRY_ADOPT_S = 5.0
MEASURE_S = 5.0


async def adopt_all(manager: VMManager) -> None:
    layout = manager.layout
    for run_dir in layout.building.iterdir():
        await kill_leftover(run_dir)  # a base snapshot's VM: its build died with the worker
    suspension.clean(layout.suspended)
    suspended = {p.name for p in layout.suspended.iterdir()
                 if not p.name.startswith(".") and (p / SANDBOX_FILE).exists()}  # fmt: skip
    for vm_id in sorted(suspended):
        # A snapshot that could not restore never replaces a VM that still runs (a disk error
        # or an operator's copy can leave one beside it): it is set aside, never deleted.
        problem = suspension.unrestorable(layout.suspended / vm_id)
        if problem and vmm_pids(layout.vms / vm_id):
            aside = suspension.set_aside(layout.suspended / vm_id)
            log.error(
                "VM %s: its suspended snapshot cannot restore (%s) while the VM still runs: "
                "the VM is kept, the snapshot moved to %s", vm_id, problem, aside,
            )  # fmt: skip
            suspended.discard(vm_id)
    for run_dir in sorted(layout.vms.iterdir()):
        vm_id = run_dir.name
        if vm_id.startswith(".") or vm_id in suspended or not (run_dir / SANDBOX_FILE).exists():
            await kill_leftover(run_dir)
            continue
        try:
            sb = SandboxVM.load(vm_id, run_dir, None)
        except UNREADABLE as e:
            log.error("VM %s: its sandbox.json is unreadable (%s); left as it is", vm_id, e)
            continue
        manager.adopt_record(sb)
        await try_adopt(manager, sb)
        log.info("VM %s found at start: %s", vm_id, sb.state)
    for vm_id in sorted(suspended):
        try:
            sb = SandboxVM.load(vm_id, layout.suspended / vm_id, None)
        except UNREADABLE as e:
            log.error("suspended sandbox %s is unreadable (%s); left as it is", vm_id, e)
            continue
        sb.condition = "suspended"
        manager.adopt_record(sb)


async def try_adopt(manager: VMManager, sb: SandboxVM) -> None:
    """Take over the VMM of a sandbox found on disk: live, crashed or unresponsive after it."""
    run_dir = manager.layout.vms / sb.id
    if not vmm_pids(run_dir):
        sb.machine = None
        # Nothing of it is in flight: /reconcile need not spare it as a VM just being made
        # (a delete the control plane finished while this worker was away is done at once).
        sb.since = float("-inf")
        sb.condition = "crashed" if (run_dir / DISK).exists() else "unresponsive"
        sb.why = (
            "its VMM was not running when the worker started"
            if sb.condition == "crashed"
            else "its VMM and its disk are gone"
        )
        return
    try:
        sb.machine = await _adopt(manager, run_dir)
        sb.condition, sb.why = "live", None
    except (VMMError, AgentError, TimeoutError, *UNREADABLE) as e:
        sb.machine = None
        sb.condition = "unresponsive"
        sb.why = f"its VMM did not answer when the worker took it over: {e or type(e).__name__}"
        log.warning("VM %s: %s (tried again every %.0f s)", sb.id, sb.why, RETRY_ADOPT_S)


async def _adopt(manager: VMManager, run_dir: Path) -> Machine:
    # A wedged VMM may never greet us on its QMP socket.
    vm = await asyncio.wait_for(manager.driver.adopt(run_dir), ADOPT_TIMEOUT_S)
    try:
        status = await manager.driver.probe(vm, PROBE_TIMEOUT_S)
        if status == "io-error":
            if manager.capacity.free_disk_mib() < 2 * FULL_MIB:
                raise VMMError("QEMU stopped it on an I/O error; waiting for the pool to have room")
            await vm.continue_after_io_error()
        paused = vm.status().state == VMState.PAUSED
        if paused:
            await vm.resume()  # only a running guest can answer our hello
        agent = await AgentClient.connect(
            vm.open_agent_stream, vm.config.agent_token, ADOPT_TIMEOUT_S
        )
        if paused:
            await vm.pause()
    except BaseException:
        await vm.detach()
        raise
    return Machine(vm, agent, {})


async def kill_leftover(directory: Path) -> None:
    """Kill whatever VMM still runs from `directory` (a run dir), then remove the directory."""
    for pid in vmm_pids(directory):
        try:
            proc = VMMProcess.adopt(pid, f"{directory}/")
        except VMMError:
            continue  # gone meanwhile
        proc.kill()
        await proc.wait()
    await asyncio.to_thread(shutil.rmtree, directory, True)


class Watch:
    """The worker's watch over its VMs, while it runs."""

    def __init__(self, manager: VMManager) -> None:
        self.manager = manager
        self.full_pool = FullPool(manager)
        self._last_retry = 0.0
        self._last_measure = 0.0

    async def run(self) -> None:
        await self.full_pool.start(self.manager.vms())
        while True:
            try:
                await self.once()
            except Exception:
                log.exception("watch over the VMs failed")
            await asyncio.sleep(WATCH_S)

    async def once(self) -> None:
        now = time.monotonic()
        vms = self.manager.vms()
        if any(sb.machine is not None and sb.machine.io_error for sb in vms):
            # Space freed on the pool shows only once its file system commits (btrfs: every
            # 30 s by itself): commit now, so a stopped guest goes on as soon as it can.
            await asyncio.to_thread(os.sync)
        await asyncio.gather(*(self._probe(sb) for sb in vms if _watched(sb)))
        await self.full_pool.check(vms)
        if now - self._last_retry >= RETRY_ADOPT_S:
            self._last_retry = now
            for sb in vms:
                if sb.condition == "unresponsive" and sb.machine is None:
                    async with self.manager.locks.hold(sb.id, cancellable=False):
                        await try_adopt(self.manager, sb)
        if now - self._last_measure >= MEASURE_S:
            self._last_measure = now
            vmms = [
                (sb.id, pid, sb.spec.memory_mib)
                for sb in vms
                if sb.machine is not None and (pid := sb.machine.status().pid) is not None
            ]
            # A hundred smaps_rollup reads take a while: off the loop, which serves the API.
            await asyncio.to_thread(self.manager.capacity.measure, vmms)

    async def _probe(self, sb: SandboxVM) -> None:
        machine = sb.machine
        assert machine is not None
        try:
            status = await self.manager.driver.probe(machine.vm, PROBE_TIMEOUT_S)
        except TimeoutError:
            if not machine.unresponsive:
                log.warning("VM %s: its VMM does not answer", sb.id)
            machine.unresponsive = True
            return
        except VMMError:
            return  # it died: its state says so
        if machine.unresponsive:
            log.info("VM %s: its VMM answers again", sb.id)
        machine.unresponsive = False
        if status != "io-error":
            machine.io_error = None
            return
        free = self.manager.capacity.free_disk_mib()
        if machine.io_error is None:
            log.warning("VM %s: stopped by QEMU on an I/O error (pool: %d MiB free)", sb.id, free)
        machine.io_error = f"a write failed; the worker's pool has {free} MiB free"
        if free >= 2 * FULL_MIB:
            with contextlib.suppress(VMMError, TimeoutError):
                await machine.vm.continue_after_io_error()
                machine.io_error = None
                log.info("VM %s: continued, the pool has room again", sb.id)


def _watched(sb: SandboxVM) -> bool:
    return (
        sb.machine is not None
        and sb.condition == "live"
        and sb.machine.status().state in (VMState.RUNNING, VMState.PAUSED, VMState.STARTING)
    )

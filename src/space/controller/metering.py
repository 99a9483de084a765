"""Metering: every `resolution_s` the leader asks each worker what its sandboxes use (GET /usage,
measured on the host) and adds what they used since the last reading to their bucket
(db/store/usage.py); the storage of checkpoints and volumes is counted from the database.

What a sandbox was given (vCPUs, RAM) is counted for the time between two readings, in the
state the second found it in; what it used (the VMM's CPU time, its NIC's bytes, its gateway's
bytes by host) is the growth of counters that start again with a new VMM. A sandbox seen for the
first time is counted from its start on its worker if that was within two readings, its
counters whole if its VMM started within two readings, else from this reading on (a new leader
does not count again what the last one did). So a figure is off
by at most one reading per change of state, per new leader, and per worker that did not answer
for longer than `GAP_READINGS` readings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from space.db.store import Store
from space.db.store.usage import Figures, Owner, TrafficSample, UsageSample
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import UsageReport, VMUsage

log = logging.getLogger(__name__)

GiB = 1 << 30
GAP_READINGS = 3  # a longer silence of a worker is not counted as time its sandboxes ran


@dataclass(frozen=True)
class Reading:
    worker: str
    at: float
    vmm: int | None
    cpu_seconds: float
    net: tuple[int, int] | None  # (rx, tx)
    traffic: dict[str, tuple[int, int]] = field(default_factory=dict)
    traffic_epoch: str | None = None


def grown(now: float, before: float | None, fresh: bool) -> float:
    """What a counter that only grows (or starts again from zero) added since `before`."""
    if before is None:
        return now if fresh else 0
    return now - before if now >= before else now


class Metering:
    def __init__(self, store: Store, workers: WorkerClient, resolution_s: int) -> None:
        self.store, self.workers = store, workers
        self.resolution_s = resolution_s
        self._last: dict[str, Reading] = {}  # sandbox id → its last reading
        self._stored_at: float | None = None

    async def once(self) -> None:
        active = [w for w in await self.store.workers() if w["state"] == "active"]
        answers = await asyncio.gather(
            *(self.workers.usage(Worker(w["id"], w["url"])) for w in active),
            return_exceptions=True,
        )
        reports: dict[str, UsageReport] = {}
        for w, answer in zip(active, answers, strict=True):
            if isinstance(answer, WorkerError | TimeoutError | OSError):
                log.info("no usage from worker %s this time: %s", w["id"], answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                reports[w["id"]] = answer
        seen = {vm.id for r in reports.values() for vm in r.vms}
        owners = await self.store.owners(sorted(seen))
        samples: list[UsageSample] = []
        traffic: list[TrafficSample] = []
        # What an answering worker no longer has starts afresh if it comes back.
        readings = {sandbox_id: last for sandbox_id, last in self._last.items()
                    if last.worker not in reports or sandbox_id in seen}  # fmt: skip
        for worker, report in reports.items():
            for vm in report.vms:
                owner = owners.get(vm.id)
                if owner is not None:  # a VM the database does not know is no one's
                    readings[vm.id] = self._count(worker, report.at, vm, owner, samples, traffic)
        now = time.time()
        samples += await self._storage(now)
        await self.store.record_usage(samples, traffic)
        # Only what was written is counted as read: after a failed write (the database away)
        # the next round counts from the same readings, and loses nothing but time past the gap.
        self._last, self._stored_at = readings, now

    def _count(
        self,
        worker: str,
        at: float,
        vm: VMUsage,
        owner: Owner,
        samples: list[UsageSample],
        traffic: list[TrafficSample],
    ) -> Reading:
        """Adds what `vm` used since its last reading to `samples` and `traffic`; its new
        reading."""
        before = self._last.get(vm.id)
        if before is not None and before.worker != worker:
            before = None  # it moved: its counters are the new worker's
        if before is not None:
            seconds = min(max(0.0, at - before.at), self.resolution_s * GAP_READINGS)
        else:
            seconds = min(vm.age_s, self.resolution_s)
        # Counters seen for the first time are counted whole only if they started lately (with
        # its VMM): an older sandbox's were counted by the leader before.
        started = vm.vmm_age_s if vm.vmm_age_s is not None else vm.age_s
        fresh = before is not None or started <= 2 * self.resolution_s
        old = before or Reading(worker, at, None, 0.0, None)
        cpu = grown(vm.cpu_seconds, old.cpu_seconds if old.vmm == vm.vmm else None, fresh)
        net, rx, tx = old.net, 0, 0
        if vm.net_rx_bytes is not None and vm.net_tx_bytes is not None:
            net = (vm.net_rx_bytes, vm.net_tx_bytes)
            rx = int(grown(net[0], old.net[0] if old.net else None, fresh))
            tx = int(grown(net[1], old.net[1] if old.net else None, fresh))
        bucket = self._bucket(at)
        egress = ingress = 0
        # The gateway's counts start again under a new epoch (it took the sandbox on anew).
        counted = old.traffic if old.traffic_epoch == vm.traffic_epoch else {}
        for host, (sent, received) in (vm.traffic or {}).items():
            was = counted.get(host)
            out = int(grown(sent, was[0] if was else None, fresh))
            back = int(grown(received, was[1] if was else None, fresh))
            if out or back:
                traffic.append(TrafficSample(bucket, self.resolution_s, owner.tenant_id, vm.id,
                                             host, out, back))  # fmt: skip
            egress, ingress = egress + out, ingress + back
        # Without the gateway's answer this time, its counts are taken up at the next.
        hosts, epoch = (old.traffic, old.traffic_epoch) if vm.traffic is None else (
            vm.traffic, vm.traffic_epoch)  # fmt: skip
        live = vm.state != "suspended"
        figures = Figures(
            seconds=seconds,
            vcpu_seconds=vm.vcpus * seconds if live else 0.0,
            memory_gib_seconds=vm.memory_mib / 1024 * seconds if live else 0.0,
            cpu_seconds=cpu,
            disk_gib_hours=vm.disk_bytes / GiB * seconds / 3600,
            snapshot_gib_hours=vm.stored_bytes / GiB * seconds / 3600,
            net_rx_bytes=rx,
            net_tx_bytes=tx,
            egress_bytes=egress,
            ingress_bytes=ingress,
        )
        samples.append(UsageSample(bucket, self.resolution_s, owner.tenant_id, vm.id, "sandbox",
                                   owner.template, vm.state, figures))  # fmt: skip
        return Reading(worker, at, vm.vmm, vm.cpu_seconds, net, hosts, epoch)

    async def _storage(self, now: float) -> list[UsageSample]:
        last = self._stored_at
        seconds = (
            self.resolution_s if last is None else min(now - last, self.resolution_s * GAP_READINGS)
        )
        bucket = self._bucket(now)
        samples = []
        for kept in await self.store.stored():
            hours = kept.bytes / GiB * seconds / 3600
            if kept.kind == "sandbox":
                figures = Figures(seconds=seconds, checkpoint_gib_hours=hours)
            else:
                figures = Figures(seconds=seconds, volume_gib_hours=hours)
            samples.append(UsageSample(bucket, self.resolution_s, kept.tenant_id, kept.subject,
                                       kept.kind, kept.template, "stored", figures))  # fmt: skip
        return samples

    def _bucket(self, at: float) -> datetime:
        start = int(at) // self.resolution_s * self.resolution_s
        return datetime.fromtimestamp(start, UTC)


async def roll_up(store: Store, fine_for: timedelta) -> None:
    """Buckets older than `fine_for` become hourly ones."""
    gone = await store.roll_up_usage(datetime.now(UTC) - fine_for)
    if gone:
        log.info("rolled %d usage rows up into hours", gone)

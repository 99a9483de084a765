"""Metering: every `resolution_s` the leader counts what sandboxes were given and used, into
buckets of that width (db/store/usage.py).

Time is counted from the state changes sandboxes recorded, exactly: each round counts the span
from where the last one stopped (a cursor kept in the database, moved in the same transaction
as what the round adds) to a moment `SETTLE_S` ago, so every second of every sandbox in
running, paused or suspended is counted once, whichever leader counts it and however short the
sandbox's life; what it was given (vCPUs, RAM) is billed by those seconds, and what it holds by
the same spans: its disk and snapshot at their size when last read, its checkpoints and volumes
at theirs in the database.

What sandboxes used (the VMM's CPU time, the disk's blocks, the NIC's and the gateway's bytes by
host) is read from each worker (GET /usage, measured on the host) and counted by how much the
counters grew since the last reading; counters start again with a new VMM or a new gateway
epoch. Counters seen for the first time are counted whole if their VMM started within two
readings, else from this reading on (a new leader does not count again what the last one did).
What a VMM used after its last reading and before it stopped is not counted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from space.db.store import Store
from space.db.store.usage import Figures, Owner, TrafficSample, UsageSample
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import UsageReport, VMUsage

log = logging.getLogger(__name__)

GiB = 1 << 30
SETTLE_S = 2.0  # state changes still being committed are this late at most
CATCH_UP_STEPS = 60  # buckets one round counts at most, when the cursor is behind


@dataclass(frozen=True)
class Reading:
    worker: str
    vmm: int | None
    cpu_seconds: float
    net: tuple[int, int] | None  # (rx, tx)
    traffic: dict[str, tuple[int, int]] = field(default_factory=dict)
    traffic_epoch: str | None = None
    disk_bytes: int = 0  # what its disk held on the pool, as last read
    stored_bytes: int = 0  # what its suspended snapshot held


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
        counted, until = await self._time(samples, readings)
        await self.store.record_usage(samples, traffic, counted_until=until)
        # Only what was written is counted as read: after a failed write (the database away)
        # the next round counts from the same readings and the same cursor.
        self._last = readings
        if counted:
            log.debug("metering counted %.1f s of time in states", counted)

    async def _time(
        self, samples: list[UsageSample], readings: dict[str, Reading]
    ) -> tuple[float, datetime | None]:
        """Time in states (and storage held over it: disks and snapshots as last read,
        checkpoints and volumes as the database has them) from the cursor on, bucket by
        bucket; how many seconds that was, and the cursor's new place (None: not moved)."""
        start, now = await self.store.usage_window()
        end = now - timedelta(seconds=SETTLE_S)
        if start is None:  # never counted yet: from one bucket ago
            start = end - timedelta(seconds=self.resolution_s)
        end = min(end, start + timedelta(seconds=self.resolution_s * CATCH_UP_STEPS))
        if end <= start:
            return 0.0, None
        stored = await self.store.stored()
        a = start
        while a < end:
            b = min(end, self._bucket(a.timestamp()) + timedelta(seconds=self.resolution_s))
            bucket, seconds = self._bucket(a.timestamp()), (b - a).total_seconds()
            for span in await self.store.time_in_states(a, b):
                live = span.state != "suspended"
                held = readings.get(span.sandbox_id)
                hours = span.seconds / 3600 / GiB
                figures = Figures(
                    seconds=span.seconds,
                    vcpu_seconds=span.vcpus * span.seconds if live else 0.0,
                    memory_gib_seconds=span.memory_mib / 1024 * span.seconds if live else 0.0,
                    disk_gib_hours=held.disk_bytes * hours if held and live else 0.0,
                    snapshot_gib_hours=held.stored_bytes * hours if held and not live else 0.0,
                )
                samples.append(UsageSample(bucket, self.resolution_s, span.tenant_id,
                                           span.sandbox_id, "sandbox", span.template, span.state,
                                           figures))  # fmt: skip
            for kept in stored:
                hours = kept.bytes / GiB * seconds / 3600
                if kept.kind == "sandbox":
                    figures = Figures(seconds=seconds, checkpoint_gib_hours=hours)
                else:
                    figures = Figures(seconds=seconds, volume_gib_hours=hours)
                samples.append(UsageSample(bucket, self.resolution_s, kept.tenant_id,
                                           kept.subject, kept.kind, kept.template, "stored",
                                           figures))  # fmt: skip
            a = b
        return (end - start).total_seconds(), end

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
        # Counters seen for the first time are counted whole only if they started lately (with
        # its VMM): an older sandbox's were counted by the leader before.
        young = vm.vmm_age_s is not None and vm.vmm_age_s <= 2 * self.resolution_s
        fresh = before is not None or young
        old = before or Reading(worker, None, 0.0, None)
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
        # Time itself (and what was given for it) is counted from state changes (`_time`).
        figures = Figures(
            cpu_seconds=cpu,
            net_rx_bytes=rx,
            net_tx_bytes=tx,
            egress_bytes=egress,
            ingress_bytes=ingress,
        )
        samples.append(UsageSample(bucket, self.resolution_s, owner.tenant_id, vm.id, "sandbox",
                                   owner.template, vm.state, figures))  # fmt: skip
        return Reading(worker, vm.vmm, vm.cpu_seconds, net, hosts, epoch, vm.disk_bytes,
                       vm.stored_bytes)  # fmt: skip

    def _bucket(self, at: float) -> datetime:
        start = int(at) // self.resolution_s * self.resolution_s
        return datetime.fromtimestamp(start, UTC)


async def roll_up(store: Store, fine_for: timedelta) -> None:
    """Buckets older than `fine_for` become hourly ones."""
    gone = await store.roll_up_usage(datetime.now(UTC) - fine_for)
    if gone:
        log.info("rolled %d usage rows up into hours", gone)

"""The worker's Prometheus metrics (SPACE_WORKER_METRICS): each live sandbox's CPU time,
memory, disk and network bytes, measured on the host at scrape time (`sandboxes.usage`); the
worker's capacity and what admission counts in use; what KSM saves and costs.

Scrapes are served on a thread of their own; the VMs are the event loop's, so a scrape asks the
loop for its figures and waits for them at most SCRAPE_S."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from space.worker import ksm
from space.worker.sandboxes import SandboxVM, VMManager, VMManagerError, usage

log = logging.getLogger(__name__)

SCRAPE_S = 10.0
LABELS = ["sandbox", "template", "worker"]


class SandboxCollector(Collector):
    def __init__(self, manager: VMManager, loop: asyncio.AbstractEventLoop) -> None:
        self.manager = manager
        self.loop = loop

    async def _measure(self) -> list[tuple[SandboxVM, usage.Usage]]:
        live = [sb for sb in self.manager.vms() if sb.state in ("running", "paused")]

        async def one(sb: SandboxVM) -> usage.Usage | None:
            try:
                return await usage.measure(sb, self.manager.network_of(sb.id))
            except (VMManagerError, OSError, LookupError) as e:  # it went away meanwhile
                log.info("no figures for %s: %s", sb.id, e)
                return None

        figures = await asyncio.gather(*(one(sb) for sb in live))
        return [(sb, u) for sb, u in zip(live, figures, strict=True) if u is not None]

    def collect(self) -> Iterator[Metric]:
        future = asyncio.run_coroutine_threadsafe(self._measure(), self.loop)
        measured = future.result(SCRAPE_S)
        cpu = CounterMetricFamily(
            "space_sandbox_cpu_seconds", "CPU time of the sandbox's VMM process", labels=LABELS
        )
        memory = GaugeMetricFamily(
            "space_sandbox_memory_bytes",
            "Proportional set size of the sandbox's VMM process",
            labels=LABELS,
        )
        disk = GaugeMetricFamily(
            "space_sandbox_disk_bytes",
            "Bytes the sandbox's root disk has allocated on the pool",
            labels=LABELS,
        )
        rx = CounterMetricFamily(
            "space_sandbox_network_receive_bytes", "Bytes the sandbox's NIC received", labels=LABELS
        )
        tx = CounterMetricFamily(
            "space_sandbox_network_transmit_bytes", "Bytes the sandbox's NIC sent", labels=LABELS
        )
        for sb, used in measured:
            labels = [sb.id, sb.spec.template, self.manager.worker_id]
            cpu.add_metric(labels, used.cpu_seconds)
            memory.add_metric(labels, used.memory_bytes)
            disk.add_metric(labels, used.disk_bytes)
            if used.net_rx_bytes is not None and used.net_tx_bytes is not None:
                rx.add_metric(labels, used.net_rx_bytes)
                tx.add_metric(labels, used.net_tx_bytes)
        yield from (cpu, memory, disk, rx, tx)
        yield from self._worker()

    def _worker(self) -> Iterator[Metric]:
        capacity = self.manager.capacity
        used = capacity.with_reserved(self.manager.held())
        worker = [self.manager.worker_id]

        def gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, text, labels=["worker"])
            g.add_metric(worker, value)
            return g

        yield gauge("space_worker_vcpus", "vCPUs the worker admits", capacity.vcpus)
        yield gauge("space_worker_vcpus_used", "vCPUs its sandboxes hold", used.vcpus)
        yield gauge("space_worker_memory_bytes", "Memory the worker admits (after its reserve)",
                    (capacity.memory_mib - capacity.reserve_mib) << 20)  # fmt: skip
        yield gauge("space_worker_memory_used_bytes",
                    f"Memory admission counts in use ({capacity.admit_memory})",
                    used.memory_mib << 20)  # fmt: skip
        merged = ksm.figures()
        if merged is not None:
            yield gauge("space_worker_ksm_saved_bytes", "Guest memory KSM merged away",
                        merged.saved_bytes)  # fmt: skip
            if merged.cpu_seconds is not None:
                c = CounterMetricFamily("space_worker_ksm_cpu_seconds", "CPU time of ksmd",
                                        labels=["worker"])  # fmt: skip
                c.add_metric(worker, merged.cpu_seconds)
                yield c

"""The leader's metering arithmetic (`controller.metering`) with the workers' answers and the
database's clock under the test's control: counters that start again, a new leader, a gateway
that does not answer once, a worker silent for long, a sandbox that moved, a write that failed;
time counted from the cursor on, once. tests/db/test_usage.py counts time in states from real
state changes; tests/platform/test_usage.py measures real sandboxes against the host's own
accounting."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from space.controller.metering import CATCH_UP_STEPS, SETTLE_S, Metering
from space.db import embedded, migrate
from space.db.store import Store, connect
from space.db.store.usage import Owner, StateTime, Stored, TrafficSample, UsageSample
from space.worker.api.client import WorkerError
from space.worker.api.models import UsageReport, VMUsage

RES = 10  # seconds a reading


T0 = datetime(2026, 12, 1, tzinfo=UTC)


class Usage:
    refuse = False  # the next write fails

    def __init__(self) -> None:
        self.samples: list[UsageSample] = []
        self.traffic: list[TrafficSample] = []
        self.cursor: datetime | None = None
        self.now = T0  # the database's clock
        self.windows: list[tuple[datetime, datetime]] = []  # asked of time_in_states
        self.workers_ = [{"id": "w1", "url": "http://w1.invalid", "state": "active"},
                         {"id": "w2", "url": "http://w2.invalid", "state": "active"}]  # fmt: skip

    async def workers(self) -> list[dict[str, Any]]:
        return self.workers_

    async def owners(self, ids: list[str]) -> dict[str, Owner]:
        return {i: Owner("tn-a", "base") for i in ids if i.startswith("sb-")}

    async def stored(self) -> list[Stored]:
        return [Stored("volume", "vol-1", "tn-a", "", 2 << 30)]

    async def usage_window(self) -> tuple[datetime | None, datetime]:
        return self.cursor, self.now

    async def time_in_states(self, start: datetime, end: datetime) -> list[StateTime]:
        self.windows.append((start, end))
        seconds = (end - start).total_seconds()
        return [StateTime("sb-1", "tn-a", "base", "running", 2, 2048, seconds)]

    async def record_usage(self, samples: list[UsageSample], traffic: list[TrafficSample],
                           counted_until: datetime | None = None) -> None:  # fmt: skip
        if self.refuse:
            self.refuse = False
            raise OSError("the database went away mid-write")
        self.samples += samples
        self.traffic += traffic
        self.cursor = counted_until or self.cursor

    def total(self, sandbox: str, name: str, state: str | None = None) -> float:
        return float(sum(getattr(s.figures, name) for s in self.samples
                   if s.subject == sandbox and (state is None or s.state == state)))  # fmt: skip


class Workers:
    def __init__(self) -> None:
        self.reports: dict[str, UsageReport | Exception] = {}

    async def usage(self, w: Any) -> UsageReport:
        answer = self.reports.get(w.id, UsageReport(at=0, vms=[]))
        if isinstance(answer, Exception):
            raise answer
        return answer


def vm(at: float, **kw: Any) -> UsageReport:
    fields = {"id": "sb-1", "state": "running", "vmm_age_s": 1.0, "vmm": 100,
              "cpu_seconds": 0.0, "net_rx_bytes": 0, "net_tx_bytes": 0, "traffic": {}}  # fmt: skip
    return UsageReport(at=at, vms=[VMUsage(**{**fields, **kw})])


@pytest.fixture
def world() -> tuple[Usage, Workers, Metering]:
    store, workers = Usage(), Workers()
    return store, workers, Metering(store, workers, RES)  # type: ignore[arg-type]


async def test_given_and_used_add_up_over_readings(world: tuple[Usage, Workers, Metering]) -> None:
    store, workers, meter = world
    t0 = 1_000_000.0
    workers.reports["w1"] = vm(t0, vmm_age_s=4.0, cpu_seconds=3.0, net_tx_bytes=500,
                               traffic={"pypi.org": (100, 1000)})  # fmt: skip
    await meter.once()
    # Young: its counters counted whole.
    assert store.total("sb-1", "cpu_seconds") == 3.0
    assert store.total("sb-1", "net_tx_bytes") == 500
    assert store.total("sb-1", "egress_bytes") == 100
    workers.reports["w1"] = vm(t0 + RES, vmm_age_s=14.0, state="paused", cpu_seconds=5.5,
                               net_tx_bytes=800, traffic={"pypi.org": (150, 3000),
                                                          "github.com": (7, 9)})  # fmt: skip
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 5.5
    assert store.total("sb-1", "net_tx_bytes") == 800
    assert store.total("sb-1", "egress_bytes") == 157
    assert store.total("sb-1", "ingress_bytes") == 3009
    by_host = {(x.host, x.sent, x.received) for x in store.traffic}
    assert by_host == {("pypi.org", 100, 1000), ("pypi.org", 50, 2000), ("github.com", 7, 9)}
    # Volumes are counted by their size, for the time the rounds counted.
    volume = [s for s in store.samples if s.subject == "vol-1"]
    assert volume and all(s.state == "stored" and s.kind == "volume" for s in volume)
    assert store.total("vol-1", "volume_gib_hours") == pytest.approx(2 * RES / 3600)


async def test_counters_that_start_again_are_counted_whole(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, cpu_seconds=50.0, net_rx_bytes=10_000)
    await meter.once()
    # A resume: a new VMM, its CPU time from zero; the gateway forgot it (fewer bytes).
    workers.reports["w1"] = vm(RES, vmm=200, cpu_seconds=60.0, net_rx_bytes=4000, vmm_age_s=2)
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 50.0 + 60.0
    assert store.total("sb-1", "net_rx_bytes") == 10_000 + 4000


async def test_a_new_leader_counts_an_old_sandbox_from_its_first_reading(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    old = 3600.0  # running for an hour, which the last leader counted
    workers.reports["w1"] = vm(0.0, vmm_age_s=old, cpu_seconds=900.0,
                               traffic={"pypi.org": (10**6, 10**7)})  # fmt: skip
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 0 and store.total("sb-1", "egress_bytes") == 0
    workers.reports["w1"] = vm(RES, vmm_age_s=old + RES, cpu_seconds=901.0,
                               traffic={"pypi.org": (10**6 + 5, 10**7)})  # fmt: skip
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 1.0 and store.total("sb-1", "egress_bytes") == 5


async def test_a_gateway_that_did_not_answer_loses_no_bytes(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, traffic={"h": (100, 0)})
    await meter.once()
    workers.reports["w1"] = vm(RES, traffic=None)
    await meter.once()
    workers.reports["w1"] = vm(2 * RES, traffic={"h": (130, 0)})
    await meter.once()
    assert store.total("sb-1", "egress_bytes") == 130


async def test_a_silent_worker_loses_nothing_its_sandboxes_used(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, vmm_age_s=0.0, cpu_seconds=1.0)
    await meter.once()
    workers.reports["w1"] = WorkerError(0, "no answer", timed_out=True)
    await meter.once()  # the other worker and the volumes are still counted
    workers.reports["w1"] = vm(100 * RES, vmm_age_s=100 * RES, cpu_seconds=40.0)
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 40.0  # what it used is counted whole


async def test_a_moved_sandbox_starts_afresh_and_strays_are_no_ones(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, cpu_seconds=7.0)
    workers.reports["w2"] = vm(0.0, id="stray-1", cpu_seconds=99.0)
    await meter.once()
    assert store.total("stray-1", "cpu_seconds") == 0 and store.total("sb-1", "cpu_seconds") == 7
    # On the second worker now: a new VMM there (the same pid by chance), counted whole.
    workers.reports["w1"] = UsageReport(at=RES, vms=[])
    workers.reports["w2"] = vm(RES, vmm_age_s=3.0, cpu_seconds=2.0)
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 9.0


async def test_a_write_that_failed_is_counted_by_the_next_round(
    world: tuple[Usage, Workers, Metering],
) -> None:
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, vmm_age_s=0.0, cpu_seconds=1.0, traffic={"h": (10, 0)})
    await meter.once()
    counted = store.cursor
    store.refuse = True
    store.now += timedelta(seconds=RES)
    workers.reports["w1"] = vm(RES, vmm_age_s=RES, cpu_seconds=4.0, traffic={"h": (30, 0)})
    with pytest.raises(OSError):
        await meter.once()
    assert store.cursor == counted  # the time it would have counted is counted next
    store.now += timedelta(seconds=RES)
    workers.reports["w1"] = vm(2 * RES, vmm_age_s=2 * RES, cpu_seconds=6.0, traffic={"h": (35, 0)})
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 6.0
    assert store.total("sb-1", "egress_bytes") == 35
    assert store.total("sb-1", "seconds") == 3 * RES  # each second once


async def test_a_round_the_database_refused_is_counted_by_the_next(
    tmp_path: Path,
) -> None:
    """PostgreSQL stopped for a round (a real one): that round's usage is not lost, nor counted
    twice, once it is back."""
    pgdata = tmp_path / "pg"
    store = Store(connect(embedded.start(pgdata)))
    try:
        await migrate.upgrade(store.engine)
        tenant = (await store.create_tenant("metered")).id
        await store.ensure_template("base")
        await store.create_sandbox(tenant, {
            "id": "sb-1", "template": "base", "vcpus": 2, "memory_mib": 2048, "disk_mib": 1024,
            "timeout_s": 300, "timeout_action": "pause"})  # fmt: skip
        await store.register_worker("w1", "http://w1.invalid", "i", 64, 65536)
        workers = Workers()
        meter = Metering(store, workers, RES)  # type: ignore[arg-type]
        workers.reports["w1"] = vm(0.0, vmm_age_s=0.0, cpu_seconds=1.0, traffic={"h": (10, 0)})
        await meter.once()
        embedded.stop(pgdata)
        workers.reports["w1"] = vm(RES, vmm_age_s=RES, cpu_seconds=4.0, traffic={"h": (30, 0)})
        with pytest.raises(OSError):
            await meter.once()
        embedded.start(pgdata)
        workers.reports["w1"] = vm(
            2 * RES, vmm_age_s=2 * RES, cpu_seconds=6.0, traffic={"h": (35, 0)}
        )
        await meter.once()
        [(_, state, total)] = [t for t in await store.usage_totals() if t[0] == tenant]
        assert state == "running"
        assert total.cpu_seconds == 6.0 and total.egress_bytes == 35  # nothing lost, nor twice
        assert (await store.usage_window())[0] is not None  # time counted up to there
    finally:
        await store.close()
        embedded.stop(pgdata)


async def test_a_worker_restart_and_a_new_leader_count_nothing_twice(
    world: tuple[Usage, Workers, Metering],
) -> None:
    """Its VMs just adopted by a restarted worker: their VMMs are old, their counters counted
    by the leader before."""
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, vmm_age_s=7200.0, cpu_seconds=5000.0,
                               traffic={"h": (10**9, 0)}, traffic_epoch="e1")  # fmt: skip
    await meter.once()
    assert store.total("sb-1", "cpu_seconds") == 0 and store.total("sb-1", "egress_bytes") == 0


async def test_the_gateways_counts_start_again_under_a_new_epoch(
    world: tuple[Usage, Workers, Metering],
) -> None:
    """The gateway took the sandbox on anew (it restarted; the sandbox was resumed): more than
    before already, and yet all of it new."""
    store, workers, meter = world
    workers.reports["w1"] = vm(0.0, traffic={"h": (100, 0)}, traffic_epoch="e1")
    await meter.once()
    workers.reports["w1"] = vm(RES, traffic={"h": (150, 0)}, traffic_epoch="e2")
    await meter.once()
    workers.reports["w1"] = vm(2 * RES, traffic={"h": (160, 0)}, traffic_epoch="e2")
    await meter.once()
    assert store.total("sb-1", "egress_bytes") == 100 + 150 + 10


async def test_time_is_counted_once_bucket_by_bucket_from_the_cursor(
    world: tuple[Usage, Workers, Metering],
) -> None:
    """From where the last round stopped (whichever leader ran it) to a moment ago, each second
    once, cut at the buckets' edges; a cursor far behind catches up a bounded step a round."""
    store, _, meter = world
    await meter.once()
    store.now += timedelta(seconds=2.5 * RES)
    await meter.once()
    store.now += timedelta(seconds=1000 * RES)  # the controller was away
    await meter.once()
    windows = store.windows
    assert all(a < b for a, b in windows)
    assert all(b == a2 for (_, b), (a2, _) in itertools.pairwise(windows))
    for a, b in windows:  # never across a bucket's edge
        assert int(a.timestamp()) // RES == (int(b.timestamp()) - 1) // RES, (a, b)
    assert windows[0][0] == T0 - timedelta(seconds=SETTLE_S + RES)  # the first: a bucket ago
    assert store.cursor == windows[-1][1]
    counted = (windows[-1][1] - windows[0][0]).total_seconds()
    assert counted == RES + 2.5 * RES + CATCH_UP_STEPS * RES
    assert store.total("sb-1", "seconds") == counted
    assert store.total("sb-1", "vcpu_seconds") == 2 * counted
    assert store.total("sb-1", "memory_gib_seconds") == 2 * counted
    assert store.total("vol-1", "volume_gib_hours") == pytest.approx(2 * counted / 3600)

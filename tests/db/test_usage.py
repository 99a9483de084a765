"""Usage records against a real PostgreSQL: what is added is read back by tenant, sandbox,
template and metadata label at any step; totals only grow; rolling buckets up into hours keeps
every sum; a tenant never reads another's usage."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from space.db import migrate
from space.db import tables as t
from space.db.store import Store, connect
from space.db.store.usage import Figures, StateTime, TrafficSample, UsageQuery, UsageSample

HOUR = timedelta(hours=1)
# A day long ago, so that nothing the other tests of the package add falls in it.
DAY = datetime(2001, 2, 3, tzinfo=UTC)


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    await s.ensure_template("base")
    yield s
    await s.close()


async def sandbox(store: Store, tenant_id: str, **metadata: str) -> str:
    values = {"id": f"sb-{secrets.token_hex(6)}", "template": "base", "vcpus": 2,
              "memory_mib": 1024, "disk_mib": 1024, "timeout_s": 300,
              "timeout_action": "pause", "metadata": metadata}  # fmt: skip
    row, _ = await store.create_sandbox(tenant_id, values)
    return str(row["id"])


def minute(n: int) -> datetime:
    return DAY + timedelta(minutes=n)


def running(tenant: str, sid: str, at: datetime, seconds: float = 60.0) -> UsageSample:
    figures = Figures(seconds=seconds, vcpu_seconds=2 * seconds, memory_gib_seconds=seconds,
                      cpu_seconds=seconds / 2, net_tx_bytes=1000, egress_bytes=700)  # fmt: skip
    return UsageSample(at, 60, tenant, sid, "sandbox", "base", "running", figures)


async def tenant(store: Store) -> str:
    return (await store.create_tenant(f"usage-{secrets.token_hex(4)}")).id


async def test_usage_is_read_back_by_group_step_and_label(store: Store) -> None:
    a, b = await tenant(store), await tenant(store)
    a1 = await sandbox(store, a, team="red")
    a2 = await sandbox(store, a, team="blue")
    b1 = await sandbox(store, b, team="red")
    samples = [running(a, a1, minute(m)) for m in range(0, 120)]  # two hours of a1
    samples += [running(a, a2, minute(m)) for m in range(30, 60)]  # half an hour of a2
    paused = UsageSample(minute(70), 60, a, a2, "sandbox", "base", "paused",
                         Figures(seconds=60, vcpu_seconds=120, memory_gib_seconds=60))  # fmt: skip
    samples += [paused, running(b, b1, minute(5))]
    traffic = [TrafficSample(minute(1), 60, a, a1, "pypi.org", 500, 9000),
               TrafficSample(minute(2), 60, a, a1, "pypi.org", 200, 1000),
               TrafficSample(minute(2), 60, a, a2, "github.com", 50, 50),
               TrafficSample(minute(3), 60, b, b1, "evil.test", 10**9, 0)]  # fmt: skip
    await store.record_usage(samples, traffic)

    def ask(**q: object) -> UsageQuery:
        base = {"since": DAY, "until": DAY + 2 * HOUR, "step_s": 3600, "tenant_id": a}
        return UsageQuery(**{**base, **q})  # type: ignore[arg-type]

    hours = await store.usage(ask())
    assert [(p.key, p.at, p.state) for p in hours] == [
        (None, DAY, "running"), (None, DAY + HOUR, "paused"), (None, DAY + HOUR, "running"),
    ]  # fmt: skip
    first = hours[0].figures
    assert first.seconds == 90 * 60 and first.vcpu_seconds == 2 * 90 * 60
    assert first.net_tx_bytes == 90 * 1000 and first.egress_bytes == 90 * 700
    assert hours[1].figures.memory_gib_seconds == 60

    by_sandbox = await store.usage(ask(by="sandbox", step_s=86400))
    seconds = {(p.key, p.state): p.figures.seconds for p in by_sandbox}
    assert seconds == {(a1, "running"): 7200, (a2, "running"): 1800, (a2, "paused"): 60}
    by_label = await store.usage(ask(by="label", label="team", step_s=86400, tenant_id=None))
    red = sum(p.figures.seconds for p in by_label if p.key == "red")
    assert red == 7200 + 60  # a1 and b1: an admin's question spans tenants
    only_red = await store.usage(ask(metadata=("team", "red"), step_s=86400))
    assert sum(p.figures.seconds for p in only_red) == 7200  # a's only
    one = await store.usage(ask(sandbox_id=a2, step_s=60))
    assert len(one) == 31 and {p.at for p in one} >= {minute(30), minute(59), minute(70)}
    assert await store.usage(ask(template="other")) == []
    # A filter value is a value, never SQL.
    assert await store.usage(ask(metadata=("team", "red' OR 1=1 --"))) == []
    odd = await store.usage(ask(by="label", label="x' OR '1'='1"))
    assert odd and {p.key for p in odd} == {None}  # no sandbox has such a label

    hosts = await store.usage_hosts(ask())
    assert [(h.host, h.sent, h.received) for h in hosts] == [
        ("pypi.org", 700, 10000), ("github.com", 50, 50),
    ]  # fmt: skip
    assert [h.host for h in await store.usage_hosts(ask(tenant_id=b))] == ["evil.test"]
    limited = await store.usage(ask(by="sandbox", step_s=60, limit=10))
    assert len(limited) == 11  # one more than asked: the caller knows there are more


async def test_the_same_row_twice_in_one_write_adds_up(store: Store) -> None:
    a = await tenant(store)
    sid = await sandbox(store, a)
    twice = [running(a, sid, minute(500)), running(a, sid, minute(500), 30.0)]
    same_host = [TrafficSample(minute(500), 60, a, sid, "h", 1, 2)] * 2
    await store.record_usage(twice, same_host)
    [point] = await store.usage(UsageQuery(DAY, DAY + timedelta(days=1), 60, a))
    assert point.figures.seconds == 90
    [host] = await store.usage_hosts(UsageQuery(DAY, DAY + timedelta(days=1), 60, a))
    assert (host.sent, host.received) == (2, 4)


async def test_totals_only_grow_and_roll_ups_keep_every_sum(store: Store) -> None:
    a = await tenant(store)
    sid = await sandbox(store, a)
    day2 = DAY + timedelta(days=40)
    samples = [replace(running(a, sid, day2 + timedelta(minutes=m)), step_s=60)
               for m in range(0, 150, 7)]  # fmt: skip
    traffic = [TrafficSample(day2 + timedelta(minutes=m), 60, a, sid, "h", m, 1)
               for m in range(0, 150, 7)]  # fmt: skip
    await store.record_usage(samples, traffic)
    totals = {(tn, st): f for tn, st, f in await store.usage_totals()}
    assert totals[(a, "running")].seconds == 60 * len(samples)

    q = UsageQuery(day2, day2 + timedelta(days=1), 86400, a)
    before = await store.usage(q)
    hosts_before = await store.usage_hosts(q)
    gone = await store.roll_up_usage(day2 + 2 * HOUR)
    assert gone >= 2 * len([m for m in range(0, 150, 7) if m < 120])  # others' old ones too
    after = await store.usage(q)
    assert after == before and await store.usage_hosts(q) == hosts_before
    async with store.engine.connect() as c:
        steps = (await c.execute(
            sa.select(t.usage.c.bucket, t.usage.c.step_s).where(t.usage.c.subject == sid)
            .order_by(t.usage.c.bucket)
        )).all()  # fmt: skip
    assert [(b - day2, s) for b, s in steps if s == 3600] == [(timedelta(0), 3600), (HOUR, 3600)]
    assert all(b >= day2 + 2 * HOUR for b, s in steps if s == 60)
    assert await store.roll_up_usage(day2 + 2 * HOUR) == 0  # nothing left to roll up

    await store.record_usage([running(a, sid, day2)], [])
    grown = {(tn, st): f for tn, st, f in await store.usage_totals()}
    assert grown[(a, "running")].seconds == totals[(a, "running")].seconds + 60


async def test_a_round_of_thousands_of_rows_is_written_whole(store: Store) -> None:
    """More rows than one statement may carry (PostgreSQL takes 32767 parameters)."""
    a = await tenant(store)
    at = DAY + timedelta(days=80)
    samples = [UsageSample(at, 60, a, f"sb-many-{i}", "sandbox", "base", "running",
                           Figures(seconds=1.0)) for i in range(4000)]  # fmt: skip
    traffic = [TrafficSample(at, 60, a, "sb-many-0", f"h{i}.example", 1, 2) for i in range(6000)]
    await store.record_usage(samples, traffic)
    owners = await store.owners([f"sb-many-{i}" for i in range(40000)])  # none is a sandbox
    assert owners == {}
    [total] = [f for tn, st, f in await store.usage_totals() if tn == a]
    assert total.seconds == 4000
    q = UsageQuery(at, at + HOUR, 3600, a)
    assert len(await store.usage_hosts(q, limit=10000)) == 6000


async def test_time_in_states_is_read_from_the_state_changes(store: Store) -> None:
    """Spans cut to the window, by the tenant each change was recorded for: a warm-pool member
    is the pool's until its claim, then its tenant's; a deleted sandbox stops counting."""
    t0 = datetime(2003, 4, 5, tzinfo=UTC)
    a, b = await tenant(store), await tenant(store)
    short, member = await sandbox(store, a), await sandbox(store, a)

    def at(s: float) -> datetime:
        return t0 + timedelta(seconds=s)

    changes = [
        (short, a, "created", None, "pending", 0),
        (short, a, "state", "starting", "running", 10),
        (short, a, "state", "pausing", "paused", 70),
        (short, a, "state", "resuming", "running", 100),
        (short, a, "requested", "running", "deleted", 125),  # asked: not a change of state
        (short, a, "state", "deleting", "deleted", 130),
        (member, "tn-pool", "created", None, "running", 0),
        (member, b, "created", None, "running", 50),  # its claim
        (member, b, "state", "pausing", "paused", 80),
    ]  # fmt: skip
    async with store.engine.begin() as c:
        for sid, tn, kind, before, after, s in changes:
            row = {"sandbox_id": sid, "tenant_id": tn, "type": kind, "from_state": before,
                   "to_state": after, "at": at(s)}  # fmt: skip
            await c.execute(t.events.insert().values(**row))
        sb = t.sandboxes.c
        gone = {"state": "deleted", "updated_at": at(130)}
        await c.execute(t.sandboxes.update().where(sb.id == short).values(**gone))
        await c.execute(t.sandboxes.update().where(sb.id == member).values(state="paused"))

    def spans(found: list[StateTime]) -> dict[tuple[str, str, str], float]:
        return {(x.sandbox_id, x.tenant_id, x.state): x.seconds for x in found
                if x.sandbox_id in (short, member)}  # fmt: skip

    first = spans(await store.time_in_states(at(5), at(120)))
    assert first == {
        (short, a, "running"): 60 + 20, (short, a, "paused"): 30,
        (member, "tn-pool", "running"): 45, (member, b, "running"): 30, (member, b, "paused"): 40,
    }  # fmt: skip
    then = spans(await store.time_in_states(at(120), at(200)))
    assert then == {(short, a, "running"): 10, (member, b, "paused"): 80}
    found = await store.time_in_states(at(120), at(200))
    assert {x.vcpus for x in found if x.sandbox_id == short} == {2}
    # Long after its deletion, a deleted sandbox is not even looked at.
    later = spans(await store.time_in_states(at(10_000), at(10_060)))
    assert later == {(member, b, "paused"): 60}

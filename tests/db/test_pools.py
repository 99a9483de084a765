"""The warm-pool decisions against a real PostgreSQL: how many members, where, which ones go
when room or memory runs short, and that a claim is atomic. Workers here are rows only: what
the decisions do to VMs is shown by tests/platform/test_pools.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import sqlalchemy as sa

from space.controller.pools import Pools
from space.db import migrate
from space.db import tables as t
from space.db.store import POOL_TENANT, PoolMemberBroken, Row, Store, connect

SHAPE = {"template": "base", "vcpus": 1, "memory_mib": 256, "disk_mib": 1024}


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    async with s.engine.begin() as c:
        for table in (t.events, t.sandboxes, t.workers, t.templates):
            await c.execute(table.delete())
    await s.ensure_template("base")
    yield s
    await s.close()


async def worker(store: Store, wid: str, memory_mib: int, available: int | None = None) -> None:
    await store.register_worker(wid, f"http://{wid}.invalid", "i", 64, memory_mib)
    await store.heartbeat(wid, "i", available)


async def run_members(store: Store, worker_id: str) -> list[Row]:
    """What the reconciler would do: every pending member placed on `worker_id` and running."""
    out = []
    for m in await store.pool_members():
        if m["state"] == "pending":
            await store.transition(m["id"], ["pending"], "starting", worker_id=worker_id)
            row = await store.transition(m["id"], ["starting"], "running", expires_at=None)
            assert row is not None
            out.append(row)
    return out


async def test_a_pool_fills_only_the_room_there_is(store: Store) -> None:
    await store.set_pool("base", 3, 1, 256, 1024)
    await worker(store, "w1", memory_mib=600)  # room for two members of 256 MiB
    pools = Pools(store)
    await pools.tend()
    await run_members(store, "w1")
    await pools.tend()
    members = await store.pool_members()
    assert len(members) == 2
    assert all(m["tenant_id"] == POOL_TENANT and m["expires_at"] is None for m in members)
    # Shrinking drops the surplus; a new shape replaces every member.
    await store.set_pool("base", 1, 1, 256, 1024)
    await pools.tend()
    assert len(await store.pool_members()) == 1
    await store.set_pool("base", 1, 1, 128, 1024)
    await pools.tend()
    assert await store.pool_members() == []  # the old members still hold the room
    dropping = await store.pool_members(dropping=True)
    assert len(dropping) == 2
    for m in dropping:  # the reconciler deletes them
        await store.transition(m["id"], ["running"], "deleted")
    await pools.tend()
    (member,) = await store.pool_members()
    assert member["memory_mib"] == 128 and member["state"] == "pending"


async def test_a_worker_short_of_memory_loses_its_members(store: Store) -> None:
    await store.set_pool("base", 2, 1, 256, 1024)
    await worker(store, "w1", memory_mib=4096, available=8000)
    pools = Pools(store)
    pools.reserve_mib = 1024
    await pools.tend()
    await run_members(store, "w1")
    assert len(await store.pool_members()) == 2
    await store.heartbeat("w1", "i", 500)  # the host now has 500 MiB available
    await pools.tend()
    assert len(await store.pool_members()) == 1  # one per pass, and nothing added
    await pools.tend()
    assert await store.pool_members() == []
    dropped = await store.pool_members(dropping=True)
    assert {m["reason"] for m in dropped} == {"worker w1 is short of memory"}


async def test_a_sandbox_without_room_evicts_as_few_members_as_fit_it(store: Store) -> None:
    await store.set_pool("base", 3, 1, 256, 1024)
    await worker(store, "w1", memory_mib=800)
    pools = Pools(store)
    # At most two members are made at once: refills must not crowd out real creates.
    await pools.tend()
    assert len(await store.pool_members()) == 2
    await run_members(store, "w1")
    await pools.tend()
    await run_members(store, "w1")
    assert len(await store.pool_members()) == 3  # 768 of 800 MiB
    tenant = await store.create_tenant("t")
    row, _ = await store.create_sandbox(
        tenant.id, {"id": "sb-user", **SHAPE, "timeout_s": 60, "timeout_action": "pause",
                    "env": {}, "metadata": {}},
    )  # fmt: skip
    assert await pools.evict_for(row)
    assert len(await store.pool_members()) == 2
    # Until that member is gone, the load does not show the room: no further evictions.
    assert await pools.evict_for(row)
    assert len(await store.pool_members()) == 2
    # A sandbox no worker could ever hold evicts nothing.
    big = {**dict(row), "memory_mib": 4096}
    async with store.engine.begin() as c:
        await c.execute(t.sandboxes.update().where(t.sandboxes.c.pool).values(state="deleted"))
    assert not await pools.evict_for(big)


async def test_concurrent_claims_get_distinct_members(store: Store) -> None:
    await store.set_pool("base", 2, 1, 256, 1024)
    await worker(store, "w1", memory_mib=4096)
    await Pools(store).tend()
    members = {m["id"] for m in await run_members(store, "w1")}
    tenant = await store.create_tenant("t")
    seen: list[str] = []

    async def personalise(member: Row, url: str) -> None:
        seen.append(member["id"])
        await asyncio.sleep(0.05)  # hold the lock while another claim runs

    values: dict[str, Any] = {**SHAPE, "env": {"A": "1"}, "metadata": {}, "timeout_s": 60,
                              "network": None, "secrets": [],
                              "timeout_action": "pause", "idempotency_key": None}  # fmt: skip
    claims = await asyncio.gather(
        *(store.claim_pooled(tenant.id, values, personalise) for _ in range(3))
    )
    got = [r["id"] for r in claims if r is not None]
    assert sorted(got) == sorted(members) and claims.count(None) == 1
    assert sorted(seen) == sorted(members)
    for r in claims:
        if r is not None:
            assert r["tenant_id"] == tenant.id and not r["pool"] and r["boot"] == "pool"
            assert r["env"] == {"A": "1"} and r["expires_at"] is not None


async def test_a_member_that_fails_its_claim_is_dropped_and_the_next_one_taken(
    store: Store,
) -> None:
    await store.set_pool("base", 2, 1, 256, 1024)
    await worker(store, "w1", memory_mib=4096)
    await Pools(store).tend()
    first, second = sorted(await run_members(store, "w1"), key=lambda m: m["created_at"])
    tenant = await store.create_tenant("t")

    async def personalise(member: Row, url: str) -> None:
        if member["id"] == first["id"]:
            raise PoolMemberBroken("agent gone")

    values: dict[str, Any] = {**SHAPE, "env": {}, "metadata": {}, "timeout_s": 60,
                              "network": None, "secrets": [],
                              "timeout_action": "pause"}  # fmt: skip
    row = await store.claim_pooled(tenant.id, values, personalise)
    assert row is not None and row["id"] == second["id"]
    async with store.engine.connect() as c:
        broken = (
            (await c.execute(sa.select(t.sandboxes).where(t.sandboxes.c.id == first["id"])))
            .mappings()
            .one()
        )
    # Rolled back to the pool's, then asked to be deleted: never the tenant's.
    assert broken["tenant_id"] == POOL_TENANT and broken["desired_state"] == "deleted"
    assert broken["reason"] == "claim failed: agent gone"
    assert await store.claim_pooled(tenant.id, values, personalise) is None

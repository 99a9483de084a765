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
from space.db.store import POOL_TENANT, Refused, Row, Store, connect
from space.settings import PoolSettings
from tests.db.conftest import clean

SHAPE = {"template": "base", "vcpus": 1, "memory_mib": 256, "disk_mib": 1024}


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    await clean(s)
    await s.ensure_template("base")
    yield s
    await s.close()


async def worker(store: Store, wid: str, memory_mib: int, available: int | None = None) -> None:
    await store.register_worker(wid, f"http://{wid}.invalid", "i", 64, memory_mib)
    await mem_available(store, wid, available)


async def mem_available(store: Store, wid: str, mib: int | None) -> None:
    """The host's MemAvailable, as the controller's probe of the worker records it."""
    async with store.engine.begin() as c:
        q = t.workers.update().where(t.workers.c.id == wid).values(mem_available_mib=mib)
        await c.execute(q)


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
    pools = Pools(store, PoolSettings())
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
    pools = Pools(store, PoolSettings())
    pools.reserve_mib = 1024
    await pools.tend()
    await run_members(store, "w1")
    assert len(await store.pool_members()) == 2
    await mem_available(store, "w1", 500)  # the host now has 500 MiB available
    await pools.tend()
    assert len(await store.pool_members()) == 1  # one per pass, and nothing added
    await pools.tend()
    assert await store.pool_members() == []
    dropped = await store.pool_members(dropping=True)
    assert {m["reason"] for m in dropped} == {"worker w1 is short of memory"}


async def test_a_sandbox_without_room_evicts_as_few_members_as_fit_it(store: Store) -> None:
    await store.set_pool("base", 3, 1, 256, 1024)
    await worker(store, "w1", memory_mib=800)
    pools = Pools(store, PoolSettings())
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


CLAIM_VALUES: dict[str, Any] = {**SHAPE, "env": {"A": "1"}, "metadata": {}, "timeout_s": 60,
                                "network": None, "secrets": [], "timeout_action": "pause",
                                "idempotency_key": None}  # fmt: skip


async def test_concurrent_claims_get_distinct_members(store: Store) -> None:
    await store.set_pool("base", 2, 1, 256, 1024)
    await worker(store, "w1", memory_mib=4096)
    await Pools(store, PoolSettings()).tend()
    members = {m["id"] for m in await run_members(store, "w1")}
    claims = await asyncio.gather(
        *(store.claim_member(CLAIM_VALUES, f"token-{i}") for i in range(3))
    )
    got = [c["id"] for c in claims if c is not None]
    assert sorted(got) == sorted(members) and claims.count(None) == 1
    for c in claims:
        if c is not None:
            # Claimed, but still the pool's: no tenant can see it until it is confirmed.
            assert c["state"] == "claiming" and c["tenant_id"] == POOL_TENANT
            assert c["worker_url"] == "http://w1.invalid"


async def test_a_confirmed_claim_is_the_tenants_and_an_abandoned_one_never_is(
    store: Store,
) -> None:
    await store.set_pool("base", 2, 1, 256, 1024)
    await worker(store, "w1", memory_mib=4096)
    await Pools(store, PoolSettings()).tend()
    await run_members(store, "w1")
    tenant = await store.create_tenant("t")
    first = await store.claim_member(CLAIM_VALUES, "one")
    second = await store.claim_member(CLAIM_VALUES, "two")
    assert first is not None and second is not None
    # A confirmation with another claim's token does nothing.
    assert await store.confirm_claim(first["id"], "two", tenant.id, CLAIM_VALUES) is None
    row = await store.confirm_claim(first["id"], "one", tenant.id, CLAIM_VALUES)
    assert row is not None and row["tenant_id"] == tenant.id and not row["pool"]
    assert row["state"] == "running" and row["boot"] == "pool" and row["env"] == {"A": "1"}
    assert row["expires_at"] is not None
    # The hand-over of the second failed: it is dropped, and a late confirmation is refused.
    assert await store.abandon_claim(second["id"], "two", "claim failed: agent gone")
    assert await store.confirm_claim(second["id"], "two", tenant.id, CLAIM_VALUES) is None
    async with store.engine.connect() as c:
        q = sa.select(t.sandboxes).where(t.sandboxes.c.id == second["id"])
        dropped = (await c.execute(q)).mappings().one()
    assert dropped["tenant_id"] == POOL_TENANT and dropped["desired_state"] == "deleted"
    assert dropped["reason"] == "claim failed: agent gone"
    assert await store.claim_member(CLAIM_VALUES, "three") is None


async def test_a_template_made_of_a_checkpoint_takes_its_shape_and_so_does_its_pool(
    store: Store,
) -> None:
    await worker(store, "w1", memory_mib=8192)
    record = {"name": "ck", "size_bytes": 1 << 20}
    await store.request_build("ck", "r1", "[template]", b"", None)
    await store.begin_build("ck", "r1", "w1", "b1")
    await store.finish_build("ck", "b1", record, None)
    await store.set_pool("ck", 2, 1, 256, 1024)
    pools = Pools(store, PoolSettings())
    await pools.tend()
    assert len(await run_members(store, "w1")) == 2

    # Made again of a checkpoint on another worker: refused, it lives on w1.
    elsewhere = {"id": "ck-x", "worker_id": "w2"}
    with pytest.raises(Refused, match="lives on worker w1"):
        await store.request_build("ck", "r2", "", b"", None, elsewhere)
    # Of a checkpoint of a 2-vCPU, 512 MiB sandbox on w1: the pool takes that shape.
    await store.request_build("ck", "r3", "", b"", None, {"id": "ck-y", "worker_id": "w1"})
    await store.begin_build("ck", "r3", "w1", "b3")
    await store.finish_build("ck", "b3", {**record, "vcpus": 2, "memory_mib": 512}, None)
    (tpl,) = await store.templates("ck")
    assert (tpl["pool_vcpus"], tpl["pool_memory_mib"], tpl["pool_size"]) == (2, 512, 2)
    assert await store.pool_members() == []
    dropping = await store.pool_members(dropping=True)
    assert len(dropping) == 2 and all(m["memory_mib"] == 256 for m in dropping)

"""Placement against a real PostgreSQL: memory counted as the worker measured it, plus what was
placed since; never measured, by guest RAM; warm-pool members giving way on request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from space.controller.placement import Need, pick_worker, shortage, used_memory_mib
from space.db import migrate
from space.db.store import Row, Store, connect
from tests.db.conftest import clean

SHAPE = {"template": "base", "vcpus": 1, "memory_mib": 256, "disk_mib": 1024}
NEED = Need(1, 256)


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    await clean(s)
    await s.ensure_template("base")
    await s.register_worker("w1", "http://w1.invalid", "i", 64, 1000)
    yield s
    await s.close()


async def running(store: Store, tenant: str, n: int) -> list[Row]:
    rows = []
    for _ in range(n):
        row, _ = await store.create_sandbox(
            tenant, {"id": f"sb-{len(rows)}-{id(rows)}-{n}", **SHAPE, "timeout_s": 60,
                     "timeout_action": "pause", "env": {}, "metadata": {}},
        )  # fmt: skip
        await store.transition(row["id"], ["pending"], "starting", worker_id="w1")
        done = await store.transition(row["id"], ["starting"], "running")
        assert done is not None
        rows.append(done)
    return rows


async def w1(store: Store) -> Row:
    w = await store.worker("w1")
    assert w is not None
    return w


async def test_memory_is_counted_as_measured_plus_what_came_since(store: Store) -> None:
    tenant = (await store.create_tenant("t")).id
    await running(store, tenant, 3)
    load = await store.worker_load()
    # Never measured: three guests of 256 MiB hold 768 of 1000 MiB, a fourth does not fit.
    assert used_memory_mib(await w1(store), load["w1"]) == 768
    assert shortage(await w1(store), load, NEED) is not None
    # The worker measured them at 300 MiB in all: room for two more.
    await asyncio.sleep(0.01)
    await store.worker_health("w1", 0, 300, (0, 0), None)
    load = await store.worker_load()
    assert used_memory_mib(await w1(store), load["w1"]) == 300
    assert pick_worker([await w1(store)], load, NEED) == "w1"
    # One placed after that measurement counts whole until the next.
    await running(store, tenant, 1)
    load = await store.worker_load()
    assert used_memory_mib(await w1(store), load["w1"]) == 300 + 256
    await store.worker_health("w1", 0, 380, (0, 0), None)
    assert used_memory_mib(await w1(store), (await store.worker_load())["w1"]) == 380


async def test_a_measurement_taken_before_a_placement_does_not_hide_it(store: Store) -> None:
    tenant = (await store.create_tenant("t")).id
    await running(store, tenant, 1)
    # The probe was asked 5 s ago; the sandbox changed after that, so it is fresh.
    await store.worker_health("w1", 0, 100, (0, 0), None, age_s=5.0)
    assert used_memory_mib(await w1(store), (await store.worker_load())["w1"]) == 100 + 256


async def test_members_give_way_only_when_asked(store: Store) -> None:
    await store.set_pool("base", 3, 1, 256, 1024)
    tenant = (await store.create_tenant("t")).id
    await running(store, tenant, 1)
    for _ in range(3):
        m = await store.add_pool_member((await store.templates("base"))[0])
        await store.transition(m["id"], ["pending"], "starting", worker_id="w1")
        await store.transition(m["id"], ["starting"], "running", expires_at=None)
    load = await store.worker_load()
    assert load["w1"].pool_count == 3 and load["w1"].count == 4
    w = await w1(store)
    assert used_memory_mib(w, load["w1"]) == 1024
    assert used_memory_mib(w, load["w1"], members_give_way=True) == 256
    assert shortage(w, load, NEED) is not None
    assert shortage(w, load, NEED, members_give_way=True) is None
    # Measured, members give back what they take on average, not their guest RAM.
    await asyncio.sleep(0.01)
    await store.worker_health("w1", 0, 400, (0, 0), None)
    load = await store.worker_load()
    assert used_memory_mib(await w1(store), load["w1"], members_give_way=True) == 400 - 3 * 100

"""Checkpoint records against a real PostgreSQL: what they count against the quotas while
being taken and once taken, that they go with their sandbox, and which ones the controller
removes as left half-way. What they hold on workers is shown by tests/platform."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from space.db import migrate
from space.db import tables as t
from space.db.store import Conflict, Refused, Row, Store, connect
from space.quotas import Quotas

MIB = 1 << 20


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    await s.ensure_template("base")
    await s.register_worker("wk", "http://wk.invalid", "i", 64, 65536)
    yield s
    await s.close()


async def running(store: Store, tenant_id: str) -> Row:
    values = {"id": f"sb-{secrets.token_hex(6)}", "template": "base", "vcpus": 1,
              "memory_mib": 512, "disk_mib": 1024, "timeout_s": 300,
              "timeout_action": "pause"}  # fmt: skip
    row, _ = await store.create_sandbox(tenant_id, values)
    await store.transition(row["id"], ["pending"], "starting", worker_id="wk")
    done = await store.transition(row["id"], ["starting"], "running")
    assert done is not None
    return done


async def test_checkpoints_count_against_the_quotas_and_go_with_their_sandbox(
    store: Store,
) -> None:
    tenant = await store.create_tenant(f"ck-{secrets.token_hex(3)}")
    quotas = Quotas(checkpoints=2, checkpoint_mib=1024)
    sb = await running(store, tenant.id)
    row, url, _epoch = await store.begin_checkpoint(tenant.id, sb["id"], "one", quotas)
    assert (row["state"], row["worker_id"], url) == ("creating", "wk", "http://wk.invalid")
    _, used = await store.quotas_of(tenant.id, quotas)
    assert (used["checkpoints"], used["checkpoint_mib"]) == (1, 512)  # its sandbox's memory
    await store.finish_checkpoint(row["id"], 100 * MIB + 1, 12.5)
    _, used = await store.quotas_of(tenant.id, quotas)
    assert used["checkpoint_mib"] == 101  # rounded up

    await store.begin_checkpoint(tenant.id, sb["id"], "two", quotas)  # 101 + 512 MiB: room
    with pytest.raises(Refused) as refused:
        await store.begin_checkpoint(tenant.id, sb["id"], "three", quotas)
    assert refused.value.status == 429 and "checkpoints" in str(refused.value)
    assert [k["name"] for k in await store.checkpoints_of(tenant.id, sb["id"])] == ["one", "two"]

    other = await store.create_tenant(f"ck-{secrets.token_hex(3)}")
    with pytest.raises(Exception, match=sb["id"]):
        await store.begin_checkpoint(other.id, sb["id"], "theirs", quotas)
    await store.request(tenant.id, sb["id"], "paused", ("running",), "pause")
    await store.transition(sb["id"], ["running"], "paused")
    with pytest.raises(Conflict):
        await store.begin_checkpoint(tenant.id, sb["id"], "paused", Quotas())

    await store.transition(sb["id"], ["paused"], "deleted")
    assert await store.checkpoints_of(tenant.id, sb["id"]) == []
    _, used = await store.quotas_of(tenant.id, quotas)
    assert (used["checkpoints"], used["checkpoint_mib"]) == (0, 0)


async def test_checkpoints_left_half_way_are_found_once_old(store: Store) -> None:
    tenant = await store.create_tenant(f"ck-{secrets.token_hex(3)}")
    sb = await running(store, tenant.id)
    left, _, _ = await store.begin_checkpoint(tenant.id, sb["id"], "", None)
    done, _, _ = await store.begin_checkpoint(tenant.id, sb["id"], "", None)
    await store.finish_checkpoint(done["id"], MIB, 1.0)
    assert left["id"] not in {k["id"] for k in await store.stale_checkpoints(600)}
    async with store.engine.begin() as c:
        await c.execute(
            t.checkpoints.update()
            .where(t.checkpoints.c.sandbox_id == sb["id"])
            .values(created_at=sa.func.now() - sa.text("interval '1 hour'"))
        )
    stale = {k["id"] for k in await store.stale_checkpoints(600)}
    assert left["id"] in stale and done["id"] not in stale

"""The audit log's queries, and that nothing can change or remove what it holds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.exc import DBAPIError

from space.db.store import AuditEntry, AuditQuery, Store


def entry(tenant: str, action: str, status: int = 200, **more: object) -> AuditEntry:
    method, _, route = action.partition(" ")
    return AuditEntry(tenant_id=tenant, key_id=f"key-{tenant}", admin=False, method=method,
                      action=action, path=route, status=status, **more)  # type: ignore[arg-type]  # fmt: skip


async def test_entries_are_read_back_by_who_what_and_when(store: Store) -> None:
    start = await store.audit(AuditQuery(after=0, limit=1000))
    after = start[-1].id if start else 0
    made = [
        entry("tn-a", "POST /v1/sandboxes", 201, created="sb-1", request_id="r1", remote="::1"),
        entry("tn-a", "POST /v1/sandboxes/{sandbox_id}/pause", params={"sandbox_id": "sb-1"}),
        entry("tn-b", "DELETE /v1/sandboxes/{sandbox_id}", 404, params={"sandbox_id": "sb-1"}),
        entry("tn-a", "PUT /v1/secrets/{name}", 500, params={"name": 'a"b\\c ? (@'}),
    ]
    for e in made:
        await store.record_audit(e)

    every = await store.audit(AuditQuery(after=after))
    assert [e.action for e in every] == [e.action for e in made]
    assert [e.outcome for e in every] == ["ok", "ok", "refused", "failed"]
    first = every[0]
    assert (first.created, first.request_id, first.remote, first.key_id) == ("sb-1", "r1", "::1",
                                                                            "key-tn-a")  # fmt: skip
    assert first.at is not None and abs(first.at - datetime.now(UTC)) < timedelta(minutes=1)
    assert [e.id for e in every] == sorted(e.id for e in every)

    def ask(**q: object) -> AuditQuery:
        return AuditQuery(after=after, **q)  # type: ignore[arg-type]

    assert [e.tenant_id for e in await store.audit(ask(tenant_id="tn-b"))] == ["tn-b"]
    # An id the call named in its path, or made.
    assert len(await store.audit(ask(subject="sb-1"))) == 3
    assert len(await store.audit(ask(subject="sb-1", tenant_id="tn-a"))) == 2
    assert len(await store.audit(ask(subject='a"b\\c ? (@'))) == 1  # a value, never a path
    assert await store.audit(ask(subject="sb")) == []
    assert [e.action for e in await store.audit(ask(action="/pause"))] == [made[1].action]
    assert len(await store.audit(ask(action="%"))) == 0  # literal, not a LIKE pattern
    assert len(await store.audit(ask(key_id="key-tn-a"))) == 3
    # Paging by id, and time ranges.
    page = await store.audit(ask(limit=2))
    rest = await store.audit(AuditQuery(after=page[-1].id))
    assert [e.id for e in page + rest] == [e.id for e in every]
    assert len(await store.audit(ask(since=first.at))) == 4
    assert await store.audit(ask(until=first.at)) == []
    assert await store.audit(ask(since=datetime.now(UTC) + timedelta(hours=1))) == []


@pytest.mark.parametrize(
    "statement",
    ["UPDATE audit_log SET status = 200", "DELETE FROM audit_log", "TRUNCATE audit_log"],
)
async def test_nothing_changes_or_removes_an_entry(store: Store, statement: str) -> None:
    await store.record_audit(entry("tn-c", "POST /v1/volumes", 500))
    before = await store.audit(AuditQuery(limit=1000))
    with pytest.raises(DBAPIError, match="append-only"):
        async with store.engine.begin() as c:
            await c.exec_driver_sql(statement)
    assert await store.audit(AuditQuery(limit=1000)) == before

"""Tenants and keys on a real PostgreSQL: names unique, keys stored as hashes and listed without
them, revocation scoped to the tenant named and effective at once."""

from __future__ import annotations

import secrets

import pytest

from space.db.store import POOL_NAME, POOL_TENANT, Refused, Store, Tenant, key_id_of
from space.quotas import Quotas


async def test_a_name_is_one_tenant(store: Store) -> None:
    name = f"t-{secrets.token_hex(4)}"
    made = await store.create_tenant(name)
    assert await store.create_tenant(name) == made  # `space admin create-key` reuses it
    with pytest.raises(Refused) as refused:
        await store.create_tenant(name, exist_ok=False)
    assert refused.value.status == 409
    with pytest.raises(ValueError, match="reserved"):
        await store.create_tenant(POOL_NAME)


async def test_keys_listed_without_secrets_and_revoked_per_tenant(store: Store) -> None:
    a = await store.create_tenant(f"a-{secrets.token_hex(4)}")
    b = await store.create_tenant(f"b-{secrets.token_hex(4)}")
    key = await store.create_api_key(a.id, "ci", admin=True)
    kid = key_id_of(key)
    listed = await store.api_keys(a.id)
    assert [dict(r) for r in listed] == [
        {"id": kid, "name": "ci", "admin": True, "created_at": listed[0]["created_at"]}
    ]
    assert await store.api_keys(b.id) == []
    rows = {r["id"]: r for r in await store.tenants()}
    assert POOL_TENANT not in rows
    assert (rows[a.id]["keys"], rows[a.id]["sandboxes"], rows[b.id]["keys"]) == (1, 0, 0)
    assert [r["name"] for r in await store.tenants(b.id)] == [b.name]

    assert await store.authenticate(key) == Tenant(a.id, a.name, True, kid)
    assert not await store.revoke_api_key(kid, b.id)  # not b's key: untouched
    assert await store.authenticate(key) is not None
    assert await store.revoke_api_key(kid, a.id)
    assert await store.authenticate(key) is None
    assert not await store.revoke_api_key(kid)  # once
    assert await store.api_keys(a.id) == []
    assert (await store.tenants(a.id))[0]["keys"] == 0


async def test_a_deleted_tenant_gets_nothing_more_even_from_a_call_already_made(
    store: Store,
) -> None:
    """A create its key made just before the deletion, reaching the database after it, is
    refused: the tenant's row is locked by both, and the later one sees it deleted."""
    await store.ensure_template("base")
    doomed = await store.create_tenant(f"d-{secrets.token_hex(4)}")
    key = await store.create_api_key(doomed.id)
    held = await store.delete_tenant(doomed.id)
    assert (held.sandboxes, held.volumes, held.keys) == ([], [], 1)
    assert await store.authenticate(key) is None
    values = {"id": f"sb-{secrets.token_hex(6)}", "template": "base", "vcpus": 1,
              "memory_mib": 256, "disk_mib": 1024, "timeout_s": 60,
              "timeout_action": "pause"}  # fmt: skip
    for quotas in (None, Quotas()):
        with pytest.raises(Refused) as refused:
            await store.create_sandbox(doomed.id, values, quotas)
        assert refused.value.status == 404 and "deleted" in str(refused.value)
    with pytest.raises(Refused):
        await store.create_volume(doomed.id, "v", 16, Quotas())
    with pytest.raises(Refused) as again:
        await store.delete_tenant(doomed.id)
    assert again.value.status == 404
    # Its name is free again; the new tenant of that name is another.
    assert (await store.create_tenant(doomed.name, exist_ok=False)).id != doomed.id

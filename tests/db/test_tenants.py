"""Tenants and keys on a real PostgreSQL: names unique, keys stored as hashes and listed without
them, revocation scoped to the tenant named and effective at once."""

from __future__ import annotations

import secrets

import pytest

from space.db.store import POOL_NAME, POOL_TENANT, Refused, Store, Tenant, key_id_of


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

"""Secrets at rest on a real PostgreSQL: sealed, bound to their owner, and re-sealed by a key
rotation so the old key can go."""

from __future__ import annotations

import base64
import os

import pytest
import sqlalchemy as sa

from space.db import tables as t
from space.db.sealing import Sealer, SealError
from space.db.store import Refused, Store


def key(kid: str) -> tuple[str, bytes]:
    return kid, os.urandom(32)


async def test_sealed_at_rest_bound_to_owner_and_rotated(store: Store) -> None:
    k1, k2 = key("k1"), key("k2")
    a, b = await store.create_tenant("sec-a"), await store.create_tenant("sec-b")
    old = Sealer([k1])
    await store.put_secret(a.id, "token", "s3cret-value", old)
    async with store.engine.connect() as c:
        row = (await c.execute(sa.select(t.secrets).where(t.secrets.c.tenant_id == a.id))).one()
    assert b"s3cret-value" not in bytes(row.sealed) and row.key_id == "k1"
    assert await store.open_secrets(a.id, ["token"], old) == {"token": "s3cret-value"}

    # The same ciphertext under another tenant's name does not open.
    async with store.engine.begin() as c:
        await c.execute(t.secrets.insert().values(tenant_id=b.id, name="token", key_id="k1",
                                                  sealed=row.sealed))  # fmt: skip
    with pytest.raises(SealError):
        await store.open_secrets(b.id, ["token"], old)
    with pytest.raises(Refused):
        await store.open_secrets(a.id, ["nope"], old)
    with pytest.raises(SealError, match=f"token of tenant {b.id}"):
        await store.reseal_secrets(Sealer([k2, k1]))  # names what does not open; changes nothing
    async with store.engine.begin() as c:
        await c.execute(t.secrets.delete().where(t.secrets.c.tenant_id == b.id))

    # Rotation: the new key first, the old one still known; re-seal; the old key can go.
    assert await store.reseal_secrets(Sealer([k2, k1])) >= 1
    assert await store.open_secrets(a.id, ["token"], Sealer([k2])) == {"token": "s3cret-value"}
    with pytest.raises(SealError, match="k2"):
        await store.open_secrets(a.id, ["token"], old)


def test_keys_from_the_environment() -> None:
    from space.settings import Settings

    raw = base64.b64encode(b"x" * 32).decode()
    settings = Settings.from_env({"SPACE_SECRETS_KEYS": f"new:{raw},old:{raw}"})
    assert [kid for kid, _ in settings.load_sealing_keys()] == ["new", "old"]
    short = Settings.from_env({"SPACE_SECRETS_KEYS": "short:" + base64.b64encode(b"x").decode()})
    with pytest.raises(ValueError, match="32 bytes"):
        short.load_sealing_keys()

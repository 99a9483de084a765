"""Files uploaded for E2B's template builds, on a real PostgreSQL: an upload needs the token it
was asked for with, lands once, stays its tenant's, and a tenant's uploads are bounded."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from space.db import tables as t
from space.db.store import Refused, Store
from space.db.store import uploads as u

H1, H2 = "1" * 64, "2" * 64


async def test_an_upload_takes_its_token_lands_once_and_stays_its_tenants(store: Store) -> None:
    a, b = await store.create_tenant("up-a"), await store.create_tenant("up-b")
    token = await store.want_upload(a.id, H1)
    assert token is not None
    again = await store.want_upload(a.id, H1)  # asked again: only the newest token uploads
    assert again is not None and again != token
    assert await store.upload_owner(H1, token) is None
    assert await store.upload_owner(H1, again) == a.id
    with pytest.raises(Refused) as refused:
        await store.put_upload(a.id, H1, token, b"old token")
    assert refused.value.status == 403
    await store.put_upload(a.id, H1, again, b"the files")
    assert await store.upload_owner(H1, again) is None  # it came: the token asks for nothing
    with pytest.raises(Refused):
        await store.put_upload(a.id, H1, again, b"a second time")
    assert await store.want_upload(a.id, H1) is None  # here: nothing to upload
    assert await store.uploads(a.id, [H1, H2]) == {H1: b"the files"}
    assert await store.uploads(b.id, [H1]) == {}  # another tenant's hash is not its files
    assert await store.want_upload(b.id, H1) is not None


async def test_a_tenants_uploads_are_bounded_and_forgotten_after_a_day(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = await store.create_tenant("up-room")
    monkeypatch.setattr(u, "TENANT_UPLOAD_BYTES", 10)
    first, second = await store.want_upload(a.id, H1), await store.want_upload(a.id, H2)
    assert first is not None and second is not None
    await store.put_upload(a.id, H1, first, b"123456")
    with pytest.raises(Refused) as refused:
        await store.put_upload(a.id, H2, second, b"123456")
    assert refused.value.status == 413
    async with store.engine.begin() as c:
        await c.execute(t.e2b_uploads.update().values(created_at=sa.func.now() - sa.text(
            "interval '25 hours'")))  # fmt: skip
    assert await store.want_upload(a.id, H2) is not None  # asking forgets what is a day old
    assert await store.uploads(a.id, [H1]) == {}

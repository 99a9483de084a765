"""Files E2B's template builder uploads before it starts a build (`e2b/templates.py`): one row
per tenant and SDK hash, first with the hash of the token its upload URL carries, then with
the file. A day after it was asked for, a row is forgotten whatever became of it."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from space.db import tables as t
from space.db.store.base import Queries, Refused
from space.db.store.quotas import lock_for

UPLOAD_TTL_S = 86_400
TENANT_UPLOAD_BYTES = 1 << 30  # what a tenant's uploads may hold at once
TENANT_UPLOADS = 1000  # rows a tenant may have at once (each asked-for hash is one)


def _sha(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class UploadQueries(Queries):
    async def want_upload(self, tenant_id: str, file_hash: str) -> str | None:
        """None when the tenant's file of that hash is here; otherwise a token that uploads it
        (a new one each time: an earlier one no longer does)."""
        token = secrets.token_urlsafe(24)
        token_sha256 = _sha(token)
        u = t.e2b_uploads.c
        async with self.engine.begin() as c:
            await lock_for(c, tenant_id, None)  # its rows are counted: one at a time
            await self._forget_old(c)
            held = await c.scalar(sa.select(sa.func.count()).where(u.tenant_id == tenant_id))
            if int(held or 0) >= TENANT_UPLOADS:
                raise Refused(429, f"this tenant has {TENANT_UPLOADS} uploads asked for or kept: "
                                   "build with those, or wait a day")  # fmt: skip
            q = (
                pg_insert(t.e2b_uploads)
                .values(tenant_id=tenant_id, hash=file_hash, token_sha256=token_sha256)
                .on_conflict_do_update(
                    index_elements=[u.tenant_id, u.hash],
                    set_={"token_sha256": token_sha256, "created_at": sa.func.now()},
                    where=u.data.is_(None),
                )
                .returning(u.hash)
            )
            wanted = (await c.execute(q)).first() is not None
        return token if wanted else None

    async def upload_owner(self, file_hash: str, token: str) -> str | None:
        """The tenant whose upload of that hash a token asks for, if it has not come yet."""
        u = t.e2b_uploads.c
        q = sa.select(u.tenant_id).where(
            u.hash == file_hash, u.token_sha256 == _sha(token), u.data.is_(None)
        )
        async with self.engine.connect() as c:
            return await c.scalar(q)

    async def put_upload(self, tenant_id: str, file_hash: str, token: str, data: bytes) -> None:
        """Keep the file a token asked for (`upload_owner` says whose); Refused for another
        token, a file already here or one past the tenant's room."""
        u = t.e2b_uploads.c
        async with self.engine.begin() as c:
            await lock_for(c, tenant_id, None)  # one upload of a tenant at a time: its room
            held = await c.scalar(
                sa.select(sa.func.coalesce(sa.func.sum(sa.func.octet_length(u.data)), 0))
                .where(u.tenant_id == tenant_id)
            )  # fmt: skip
            if int(held or 0) + len(data) > TENANT_UPLOAD_BYTES:
                raise Refused(413, f"this tenant's uploads would pass {TENANT_UPLOAD_BYTES >> 20} "
                              "MiB: build with those uploaded, or wait a day")  # fmt: skip
            done = await c.execute(
                t.e2b_uploads.update()
                .where(u.tenant_id == tenant_id, u.hash == file_hash,
                       u.token_sha256 == _sha(token), u.data.is_(None))
                .values(data=data)
            )  # fmt: skip
            if done.rowcount != 1:
                raise Refused(403, f"no upload of {file_hash} is asked for with this URL")

    async def uploads(self, tenant_id: str, hashes: Sequence[str]) -> dict[str, bytes]:
        """The tenant's files of these hashes that are here."""
        u = t.e2b_uploads.c
        q = sa.select(u.hash, u.data).where(
            u.tenant_id == tenant_id, u.hash.in_(list(hashes)), u.data.is_not(None)
        )
        async with self.engine.connect() as c:
            return {row.hash: row.data for row in await c.execute(q)}

    async def _forget_old(self, c: AsyncConnection) -> None:
        u = t.e2b_uploads.c
        age = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, UPLOAD_TTL_S)
        await c.execute(t.e2b_uploads.delete().where(u.created_at < age))

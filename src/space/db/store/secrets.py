"""Tenants' secrets, sealed at rest (only the sealed form is stored)."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from space.db import tables as t
from space.db.sealing import Sealer, SealError
from space.db.store.base import Queries, Refused, Row
from space.db.store.quotas import lock_for


def _secret_context(tenant_id: str, name: str) -> str:
    # Bound into the ciphertext: a sealed value copied to another tenant's row does not open.
    return f"secret:{tenant_id}:{name}"


class SecretQueries(Queries):
    async def put_secret(self, tenant_id: str, name: str, value: str, sealer: Sealer) -> Row:
        """Create or replace a secret; only its sealed form is stored."""
        key_id, sealed = sealer.seal(value.encode(), _secret_context(tenant_id, name))
        values = {"key_id": key_id, "sealed": sealed, "updated_at": sa.func.now()}
        sc = t.secrets.c
        async with self.engine.begin() as c:
            await lock_for(c, tenant_id, None)  # refused for a tenant deleted meanwhile
            q = (
                pg_insert(t.secrets)
                .values(tenant_id=tenant_id, name=name, **values)
                .on_conflict_do_update(index_elements=[sc.tenant_id, sc.name], set_=values)
                .returning(sc.name, sc.created_at, sc.updated_at)
            )
            return (await c.execute(q)).mappings().one()

    async def secrets(self, tenant_id: str) -> list[Row]:
        sc = t.secrets.c
        q = (
            sa.select(sc.name, sc.created_at, sc.updated_at)
            .where(sc.tenant_id == tenant_id)
            .order_by(sc.name)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def delete_secret(self, tenant_id: str, name: str) -> None:
        """Refused while a sandbox that is not deleted has it bound."""
        s, sc = t.sandboxes.c, t.secrets.c
        async with self.engine.begin() as c:
            users = await c.execute(
                sa.select(s.id)
                .where(
                    s.tenant_id == tenant_id,
                    s.state != "deleted",
                    s.secrets.contains([{"secret": name}]),
                )
                .order_by(s.id)
                .limit(20)
            )
            ids = [r.id for r in users]
            if ids:
                raise Refused(409, f"secret {name} is bound to {', '.join(ids)}")
            res = await c.execute(
                t.secrets.delete().where(sc.tenant_id == tenant_id, sc.name == name)
            )
            if res.rowcount != 1:
                raise Refused(404, f"no secret {name}")

    async def open_secrets(
        self, tenant_id: str, names: Sequence[str], sealer: Sealer
    ) -> dict[str, str]:
        """The values of the tenant's secrets `names`; Refused(404) for one that is missing."""
        if not names:
            return {}
        sc = t.secrets.c
        q = sa.select(t.secrets).where(sc.tenant_id == tenant_id, sc.name.in_(list(names)))
        async with self.engine.connect() as c:
            rows = {r["name"]: r for r in (await c.execute(q)).mappings()}
        missing = sorted(set(names) - set(rows))
        if missing:
            raise Refused(404, f"no secret {', '.join(missing)}")
        return {
            n: sealer.open(r["key_id"], bytes(r["sealed"]), _secret_context(tenant_id, n)).decode()
            for n, r in rows.items()
        }

    async def reseal_secrets(self, sealer: Sealer) -> int:
        """Seal every secret again with the current key (after a key rotation)."""
        sc = t.secrets.c
        n = 0
        async with self.engine.begin() as c:
            rows = (await c.execute(sa.select(t.secrets).with_for_update())).mappings().all()
            for r in rows:
                if r["key_id"] == sealer.current:
                    continue
                context = _secret_context(r["tenant_id"], r["name"])
                try:
                    value = sealer.open(r["key_id"], bytes(r["sealed"]), context)
                except SealError as e:
                    raise SealError(f"secret {r['name']} of tenant {r['tenant_id']}: {e}") from None
                key_id, sealed = sealer.seal(value, context)
                await c.execute(
                    t.secrets.update()
                    .where(sc.tenant_id == r["tenant_id"], sc.name == r["name"])
                    .values(key_id=key_id, sealed=sealed)
                )
                n += 1
        return n

"""Every query SPACE makes, in one place: the `Store` over an async SQLAlchemy engine.

State changes are compare-and-set (`UPDATE … WHERE state IN (…)`), so two processes racing
for the same sandbox never both win, and every change of a sandbox is announced on the
`space_sandbox` channel (LISTEN/NOTIFY) so waiters and the controller wake at once.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from space.db import tables as t
from space.db.sealing import Sealer, SealError

CHANNEL = "space_sandbox"
POOL_TENANT = "tn-pool"  # owns warm-pool members until a create claims one (migration 0002)
POOL_NAME = "(warm pool)"
CLAIM_TRIES = 3
TRANSITIONAL = ("pending", "starting", "pausing", "resuming", "suspending", "deleting")
KEY_PREFIX = "sk_space_"

Row = sa.RowMapping


class NotFound(Exception):
    pass


class Conflict(Exception):
    """A state change that the sandbox's current state does not allow."""

    def __init__(self, sandbox_id: str, state: str, wanted: str) -> None:
        super().__init__(f"sandbox {sandbox_id} is {state}: cannot {wanted}")
        self.state = state


class Refused(Exception):
    """A request about volumes or templates that cannot be done as asked; `status` is the HTTP
    answer, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PoolMemberBroken(Exception):
    """A warm-pool member could not be handed over; it is dropped from the pool."""


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    admin: bool = False  # the key used is an admin key


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def _sha256(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def connect(url: str, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(url, pool_size=pool_size, max_overflow=20, pool_pre_ping=True)


class Store:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def close(self) -> None:
        await self.engine.dispose()

    # --- tenants and keys ----------------------------------------------------------------------

    async def create_tenant(self, name: str) -> Tenant:
        if name == POOL_NAME:
            raise ValueError(f"{name!r} is reserved for the warm pools")
        async with self.engine.begin() as c:
            existing = (
                await c.execute(sa.select(t.tenants).where(t.tenants.c.name == name))
            ).first()
            if existing:
                return Tenant(existing.id, existing.name)
            tid = new_id("tn")
            await c.execute(t.tenants.insert().values(id=tid, name=name))
            return Tenant(tid, name)

    async def create_api_key(self, tenant_id: str, name: str = "", admin: bool = False) -> str:
        """A new key; only its hash is stored, so this is the one time it can be seen."""
        if tenant_id == POOL_TENANT:
            raise ValueError("the warm pools' tenant has no keys")
        key_id = secrets.token_hex(6)
        secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
        key = f"{KEY_PREFIX}{key_id}_{secret}"
        async with self.engine.begin() as c:
            await c.execute(
                t.api_keys.insert().values(
                    id=key_id,
                    tenant_id=tenant_id,
                    secret_sha256=_sha256(key),
                    name=name,
                    admin=admin,
                )
            )
        return key

    async def revoke_api_key(self, key_id: str) -> bool:
        async with self.engine.begin() as c:
            res = await c.execute(
                t.api_keys.update()
                .where(t.api_keys.c.id == key_id, t.api_keys.c.revoked_at.is_(None))
                .values(revoked_at=sa.func.now())
            )
            return res.rowcount == 1

    async def authenticate(self, key: str) -> Tenant | None:
        if not key.startswith(KEY_PREFIX) or len(key) > 200:
            return None
        key_id = key[len(KEY_PREFIX) :].split("_", 1)[0]
        async with self.engine.connect() as c:
            row = (
                await c.execute(
                    sa.select(
                        t.api_keys.c.secret_sha256,
                        t.api_keys.c.admin,
                        t.tenants.c.id,
                        t.tenants.c.name,
                    )
                    .join(t.tenants, t.tenants.c.id == t.api_keys.c.tenant_id)
                    .where(t.api_keys.c.id == key_id, t.api_keys.c.revoked_at.is_(None))
                )
            ).first()
        if row is None or not hmac.compare_digest(bytes(row.secret_sha256), _sha256(key)):
            return None
        return Tenant(row.id, row.name, bool(row.admin))

    # --- templates -----------------------------------------------------------------------------

    async def ensure_template(self, template_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(pg_insert(t.templates).values(id=template_id).on_conflict_do_nothing())

    async def template_exists(self, template_id: str) -> bool:
        """Whether sandboxes can be made of it: `base`, or a template built at least once
        (a rebuild under way leaves the last build usable) and not being deleted."""
        tp = t.templates.c
        q = sa.select(tp.id).where(
            tp.id == template_id,
            tp.state != "deleting",
            sa.or_(tp.record.is_not(None), tp.worker_id.is_(None)),
        )
        async with self.engine.connect() as c:
            return (await c.execute(q)).first() is not None

    async def template_worker(self, template_id: str) -> str | None:
        """The worker a built template lives on (None: on every worker, like `base`)."""
        tp = t.templates.c
        async with self.engine.connect() as c:
            q = sa.select(tp.worker_id).where(tp.id == template_id)
            return (await c.execute(q)).scalar()

    async def begin_build(self, template_id: str, worker_id: str, build_id: str) -> Row:
        """Record a build under way (the template's row is made by its first build)."""
        values = {"state": "building", "worker_id": worker_id, "build_id": build_id,
                  "error": None, "updated_at": sa.func.now()}  # fmt: skip
        async with self.engine.begin() as c:
            q = (
                pg_insert(t.templates)
                .values(id=template_id, **values)
                .on_conflict_do_update(index_elements=[t.templates.c.id], set_=values)
                .returning(*t.templates.c)
            )
            return (await c.execute(q)).mappings().one()

    async def finish_build(
        self, template_id: str, build_id: str, record: dict[str, Any] | None, error: str | None
    ) -> None:
        """A build ended: with its template's record, or with what went wrong (the last good
        build, if any, stays in use)."""
        tp = t.templates.c
        values: dict[str, Any] = {"state": "failed" if error else "ready", "error": error,
                                  "updated_at": sa.func.now()}  # fmt: skip
        if record is not None:
            values["record"] = record
        async with self.engine.begin() as c:
            await c.execute(
                t.templates.update()
                .where(tp.id == template_id, tp.build_id == build_id, tp.state == "building")
                .values(**values)
            )

    async def templates_in(self, state: str) -> list[Row]:
        q = sa.select(t.templates).where(t.templates.c.state == state)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def delete_template(self, template_id: str) -> Row:
        """Ask for a template's deletion: refused while a tenant's sandbox uses it; its pool
        is let go. The controller removes it from its worker once no sandbox needs it."""
        tp, s = t.templates.c, t.sandboxes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        sa.select(t.templates).where(tp.id == template_id).with_for_update()
                    )
                )
                .mappings()
                .first()
            )
            if row is None or row["state"] == "deleting":
                raise Refused(404, f"no template {template_id}")
            if row["worker_id"] is None:
                raise Refused(409, f"{template_id} is the platform's own template: it stays")
            users = await c.execute(
                sa.select(s.id)
                .where(s.template == template_id, s.state != "deleted", sa.not_(s.pool))
                .order_by(s.id)
                .limit(20)
            )
            ids = [r.id for r in users]
            if ids:
                raise Refused(409, f"template {template_id} is used by {', '.join(ids)}")
            await self._drop_members(c, [s.template == template_id], "the template is deleted")
            q = (
                t.templates.update()
                .where(tp.id == template_id)
                .values(state="deleting", pool_size=0, updated_at=sa.func.now())
                .returning(*t.templates.c)
            )
            return (await c.execute(q)).mappings().one()

    async def template_users(self, template_id: str) -> int:
        """Sandboxes (pool members included) of the template that are not deleted yet."""
        s = t.sandboxes.c
        q = sa.select(sa.func.count()).where(s.template == template_id, s.state != "deleted")
        async with self.engine.connect() as c:
            return int((await c.execute(q)).scalar_one())

    async def forget_template(self, template_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(t.templates.delete().where(t.templates.c.id == template_id))

    async def templates(self, template_id: str | None = None) -> list[Row]:
        """Templates with how many pool members each has ready and on the way."""
        s = t.sandboxes.c
        members = (
            sa.select(
                s.template,
                sa.func.count().filter(s.state == "running").label("pool_ready"),
                sa.func.count().filter(s.state != "running").label("pool_starting"),
            )
            .where(s.pool, s.desired_state == "running", s.state.not_in(("error", "deleted")))
            .group_by(s.template)
            .subquery()
        )
        q = (
            sa.select(
                t.templates,
                sa.func.coalesce(members.c.pool_ready, 0).label("pool_ready"),
                sa.func.coalesce(members.c.pool_starting, 0).label("pool_starting"),
            )
            .outerjoin(members, members.c.template == t.templates.c.id)
            .order_by(t.templates.c.id)
        )
        if template_id is not None:
            q = q.where(t.templates.c.id == template_id)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def set_pool(
        self, template_id: str, size: int, vcpus: int, memory_mib: int, disk_mib: int
    ) -> None:
        """Size and shape of a template's warm pool; members of another shape are let go."""
        async with self.engine.begin() as c:
            res = await c.execute(
                t.templates.update()
                .where(t.templates.c.id == template_id)
                .values(
                    pool_size=size,
                    pool_vcpus=vcpus,
                    pool_memory_mib=memory_mib,
                    pool_disk_mib=disk_mib,
                )
            )
            if res.rowcount != 1:
                raise NotFound(template_id)
            s = t.sandboxes.c
            await self._drop_members(
                c,
                [
                    s.template == template_id,
                    sa.tuple_(s.vcpus, s.memory_mib, s.disk_mib)
                    != sa.tuple_(vcpus, memory_mib, disk_mib),
                ],
                "the pool changed shape",
            )

    # --- warm pools ----------------------------------------------------------------------------

    async def pool_members(self, dropping: bool = False) -> list[Row]:
        """Pool members not deleted yet, oldest first: those that stay, or (`dropping`) those
        being deleted."""
        s = t.sandboxes.c
        wanted = s.desired_state == "deleted" if dropping else s.desired_state != "deleted"
        q = (
            sa.select(t.sandboxes)
            .where(s.pool, s.state != "deleted", wanted)
            .order_by(s.created_at)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def add_pool_member(self, template: Row) -> Row:
        """A new pool member of the template's pool shape; the reconciler starts it."""
        values = {
            "id": new_id("sb"),
            "tenant_id": POOL_TENANT,
            "template": template["id"],
            "vcpus": template["pool_vcpus"],
            "memory_mib": template["pool_memory_mib"],
            "disk_mib": template["pool_disk_mib"],
            "timeout_s": 300,
            "timeout_action": "delete",
            "state": "pending",
            "desired_state": "running",
            "pool": True,
        }
        async with self.engine.begin() as c:
            row = (
                (await c.execute(t.sandboxes.insert().values(**values).returning(*t.sandboxes.c)))
                .mappings()
                .one()
            )
            await self._event(c, row, "created", None, "pending", "warm pool")
            await _notify(c, row["id"])
            return row

    async def drop_pool_members(self, ids: Sequence[str], reason: str) -> int:
        """Ask for these pool members to be deleted (those still unclaimed)."""
        async with self.engine.begin() as c:
            return await self._drop_members(c, [t.sandboxes.c.id.in_(ids)], reason)

    async def _drop_members(self, c: AsyncConnection, where: list[Any], reason: str) -> int:
        s = t.sandboxes.c
        rows = (
            await c.execute(
                t.sandboxes.update()
                .where(s.pool, s.desired_state != "deleted", *where)
                .values(desired_state="deleted", reason=reason, updated_at=sa.func.now())
                .returning(*t.sandboxes.c)
            )
        ).mappings()
        n = 0
        for row in rows:
            await self._event(c, row, "requested", row["state"], "deleted", reason)
            await _notify(c, row["id"])
            n += 1
        return n

    async def claim_pooled(
        self,
        tenant_id: str,
        values: dict[str, Any],
        personalise: Callable[[Row, str], Awaitable[None]],
    ) -> Row | None:
        """Hand a ready pool member of this shape to the tenant; None if there is none.

        The member's row stays locked while `personalise(member, worker_url)` gives its VM the
        tenant's environment, so no two creates ever get the same member; one that fails that
        is dropped from the pool and the next is tried."""
        for _ in range(CLAIM_TRIES):
            member_id = ""
            try:
                async with self.engine.begin() as c:
                    member = await self._lock_member(c, values)
                    if member is None:
                        return None
                    member_id = member["id"]
                    # The tenant's row first: a repeated idempotency key fails here, before
                    # the VM is touched. A failed personalise rolls all of it back.
                    row = await self._hand_over(c, member_id, tenant_id, values)
                    await personalise(member, member["worker_url"])
                    await self._event(c, row, "created", None, "running", "from the warm pool")
                    await _notify(c, member_id)
                    return row
            except PoolMemberBroken as e:
                await self.drop_pool_members([member_id], f"claim failed: {e}")
        return None

    @staticmethod
    async def _lock_member(c: AsyncConnection, values: dict[str, Any]) -> Row | None:
        """The oldest ready member of this shape that no other claim holds, locked."""
        s, w = t.sandboxes.c, t.workers.c
        q = (
            sa.select(t.sandboxes, w.url.label("worker_url"))
            .join(t.workers, w.id == s.worker_id)
            .where(
                s.pool,
                s.state == "running",
                s.desired_state == "running",
                s.template == values["template"],
                s.vcpus == values["vcpus"],
                s.memory_mib == values["memory_mib"],
                s.disk_mib == values["disk_mib"],
                w.state == "active",
            )
            .order_by(s.created_at)
            .limit(1)
            .with_for_update(of=t.sandboxes, skip_locked=True)
        )
        return (await c.execute(q)).mappings().first()

    @staticmethod
    async def _hand_over(
        c: AsyncConnection, member_id: str, tenant_id: str, values: dict[str, Any]
    ) -> Row:
        q = (
            t.sandboxes.update()
            .where(t.sandboxes.c.id == member_id)
            .values(
                tenant_id=tenant_id,
                pool=False,
                boot="pool",
                reason=None,
                env=values["env"],
                network=values["network"],
                secrets=values["secrets"],
                metadata=values["metadata"],
                timeout_s=values["timeout_s"],
                timeout_action=values["timeout_action"],
                idempotency_key=values.get("idempotency_key"),
                expires_at=sa.func.now() + timedelta(seconds=values["timeout_s"]),
                created_at=sa.func.now(),
                updated_at=sa.func.now(),
            )
            .returning(*t.sandboxes.c)
        )
        return (await c.execute(q)).mappings().one()

    # --- secrets -------------------------------------------------------------------------------

    async def put_secret(self, tenant_id: str, name: str, value: str, sealer: Sealer) -> Row:
        """Create or replace a secret; only its sealed form is stored."""
        key_id, sealed = sealer.seal(value.encode(), _secret_context(tenant_id, name))
        values = {"key_id": key_id, "sealed": sealed, "updated_at": sa.func.now()}
        sc = t.secrets.c
        async with self.engine.begin() as c:
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

    # --- volumes -------------------------------------------------------------------------------

    async def create_volume(self, tenant_id: str, name: str, size_mib: int) -> Row:
        values = {"id": new_id("vol"), "tenant_id": tenant_id, "name": name,
                  "size_mib": size_mib, "state": "available"}  # fmt: skip
        async with self.engine.begin() as c:
            q = t.volumes.insert().values(**values).returning(*t.volumes.c)
            return (await c.execute(q)).mappings().one()

    async def volumes(self, tenant_id: str) -> list[Row]:
        v = t.volumes.c
        q = (
            sa.select(t.volumes)
            .where(v.tenant_id == tenant_id, v.state != "deleted")
            .order_by(v.created_at.desc(), v.id)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def volume(self, volume_id: str, tenant_id: str | None = None) -> Row:
        q = sa.select(t.volumes).where(t.volumes.c.id == volume_id)
        if tenant_id is not None:
            q = q.where(t.volumes.c.tenant_id == tenant_id, t.volumes.c.state != "deleted")
        async with self.engine.connect() as c:
            row = (await c.execute(q)).mappings().first()
        if row is None:
            raise Refused(404, f"no volume {volume_id}")
        return row

    async def delete_volume(self, tenant_id: str, volume_id: str) -> Row:
        """Ask for a volume's deletion; refused while any sandbox not deleted has it."""
        v = t.volumes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        sa.select(t.volumes)
                        .where(v.id == volume_id, v.tenant_id == tenant_id, v.state != "deleted")
                        .with_for_update()
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                raise Refused(404, f"no volume {volume_id}")
            users = await _attachments(c, volume_id)
            if users:
                names = ", ".join(sorted(u["id"] for u in users))
                raise Refused(409, f"volume {volume_id} is attached to {names}")
            state = "deleting" if row["worker_id"] else "deleted"
            q = t.volumes.update().where(v.id == volume_id).values(state=state)
            return (await c.execute(q.returning(*t.volumes.c))).mappings().one()

    async def volumes_to_delete(self) -> list[Row]:
        q = sa.select(t.volumes).where(t.volumes.c.state == "deleting")
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def volume_deleted(self, volume_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(
                t.volumes.update().where(t.volumes.c.id == volume_id).values(state="deleted")
            )

    async def sandbox_volumes(self, row: Row) -> list[dict[str, Any]]:
        """A sandbox's volumes as its worker needs them: id, size, where and how mounted."""
        wanted = {a["volume"]: a for a in row["volumes"]}
        if not wanted:
            return []
        q = sa.select(t.volumes).where(t.volumes.c.id.in_(list(wanted)))
        async with self.engine.connect() as c:
            sizes = {r["id"]: r for r in (await c.execute(q)).mappings()}
        return [
            {"id": vid, "size_mib": sizes[vid]["size_mib"], "path": a["path"],
             "read_only": bool(a.get("read_only", False)), "worker_id": sizes[vid]["worker_id"]}
            for vid, a in wanted.items()
        ]  # fmt: skip

    async def bind_volumes(self, volume_ids: Sequence[str], worker_id: str) -> None:
        """Volumes live where they are first used: later sandboxes must go there too."""
        v = t.volumes.c
        async with self.engine.begin() as c:
            await c.execute(
                t.volumes.update()
                .where(v.id.in_(list(volume_ids)), v.worker_id.is_(None))
                .values(worker_id=worker_id)
            )

    @staticmethod
    async def _check_attachments(
        c: AsyncConnection, tenant_id: str, attachments: list[dict[str, Any]]
    ) -> None:
        """The tenant's volumes, free to attach as asked: one writer, or any readers."""
        v = t.volumes.c
        ids = [a["volume"] for a in attachments]
        q = (
            sa.select(t.volumes)
            .where(v.id.in_(ids), v.tenant_id == tenant_id, v.state == "available")
            .order_by(v.id)
            .with_for_update()  # concurrent creates attaching the same volume queue here
        )
        found = {r["id"] for r in (await c.execute(q)).mappings()}
        for a in attachments:
            vid = a["volume"]
            if vid not in found:
                raise Refused(404, f"no volume {vid}")
            users = await _attachments(c, vid)
            writers = [u["id"] for u in users if not u["read_only"]]
            if writers:
                raise Refused(409, f"volume {vid} is attached read-write to {', '.join(writers)}")
            if users and not a.get("read_only"):
                names = ", ".join(u["id"] for u in users)
                raise Refused(
                    409, f"volume {vid} is attached read-only to {names}: no writer meanwhile"
                )

    # --- workers -------------------------------------------------------------------------------

    async def register_worker(
        self, worker_id: str, url: str, instance: str, vcpus: int, memory_mib: int
    ) -> None:
        values = {
            "url": url,
            "state": "active",
            "instance": instance,
            "capacity_vcpus": vcpus,
            "capacity_memory_mib": memory_mib,
            "heartbeat_at": sa.func.now(),
            "registered_at": sa.func.now(),
        }
        async with self.engine.begin() as c:
            await c.execute(
                pg_insert(t.workers)
                .values(id=worker_id, **values)
                .on_conflict_do_update(index_elements=[t.workers.c.id], set_=values)
            )

    async def heartbeat(
        self, worker_id: str, instance: str, mem_available_mib: int | None = None
    ) -> bool:
        """False if another process registered as this worker since (this one must stop)."""
        async with self.engine.begin() as c:
            res = await c.execute(
                t.workers.update()
                .where(t.workers.c.id == worker_id, t.workers.c.instance == instance)
                .values(
                    heartbeat_at=sa.func.now(), state="active", mem_available_mib=mem_available_mib
                )
            )
            return res.rowcount == 1

    async def workers(self) -> list[Row]:
        async with self.engine.connect() as c:
            return list((await c.execute(sa.select(t.workers))).mappings())

    async def worker(self, worker_id: str) -> Row | None:
        async with self.engine.connect() as c:
            q = sa.select(t.workers).where(t.workers.c.id == worker_id)
            return (await c.execute(q)).mappings().first()

    async def mark_dead_workers(self, after_s: float) -> list[str]:
        async with self.engine.begin() as c:
            res = await c.execute(
                t.workers.update()
                .where(
                    t.workers.c.state == "active",
                    t.workers.c.heartbeat_at < sa.func.now() - timedelta(seconds=after_s),
                )
                .values(state="dead")
                .returning(t.workers.c.id)
            )
            return [r.id for r in res]

    async def worker_load(self) -> dict[str, tuple[int, int]]:
        """vCPUs and MiB committed per worker by sandboxes that hold a VM."""
        s = t.sandboxes.c
        q = (
            sa.select(s.worker_id, sa.func.sum(s.vcpus), sa.func.sum(s.memory_mib))
            .where(s.worker_id.is_not(None), s.state.not_in(("deleted", "suspended")))
            .group_by(s.worker_id)
        )
        async with self.engine.connect() as c:
            return {r[0]: (int(r[1]), int(r[2])) for r in await c.execute(q)}

    # --- sandboxes -----------------------------------------------------------------------------

    async def create_sandbox(self, tenant_id: str, values: dict[str, Any]) -> tuple[Row, bool]:
        """Insert a pending sandbox; with an idempotency key or id seen before, the old one.

        Returns (row, created)."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            if values.get("volumes"):
                await self._check_attachments(c, tenant_id, values["volumes"])
            ins = (
                pg_insert(t.sandboxes)
                .values(
                    tenant_id=tenant_id,
                    state="pending",
                    desired_state="running",
                    expires_at=sa.func.now() + timedelta(seconds=values["timeout_s"]),
                    **values,
                )
                .on_conflict_do_nothing()
                .returning(*t.sandboxes.c)
            )
            row = (await c.execute(ins)).mappings().first()
            if row is not None:
                await self._event(c, row, "created", None, "pending", None)
                await _notify(c, row["id"])
                return row, True
            # A conflict: the same id or idempotency key. Same tenant → the same sandbox.
            cond = s.id == values["id"]
            if values.get("idempotency_key"):
                cond = sa.or_(
                    cond,
                    sa.and_(
                        s.tenant_id == tenant_id,
                        s.idempotency_key == values["idempotency_key"],
                    ),
                )
            existing = (await c.execute(sa.select(t.sandboxes).where(cond))).mappings().first()
            if existing is None or existing["tenant_id"] != tenant_id:
                raise Conflict(values["id"], "taken", "use this id")
            return existing, False

    async def by_idempotency_key(self, tenant_id: str, key: str) -> Row | None:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(s.tenant_id == tenant_id, s.idempotency_key == key)
        async with self.engine.connect() as c:
            return (await c.execute(q)).mappings().first()

    async def get_sandbox(self, sandbox_id: str, tenant_id: str | None = None) -> Row:
        q = sa.select(t.sandboxes).where(t.sandboxes.c.id == sandbox_id)
        if tenant_id is not None:
            q = q.where(t.sandboxes.c.tenant_id == tenant_id)
        async with self.engine.connect() as c:
            row = (await c.execute(q)).mappings().first()
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def list_sandboxes(
        self,
        tenant_id: str,
        *,
        state: str | None = None,
        template: str | None = None,
        metadata: dict[str, str] | None = None,
        limit: int = 50,
        after: tuple[datetime, str] | None = None,
    ) -> list[Row]:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(s.tenant_id == tenant_id)
        if state:
            q = q.where(s.state == state)
        if template:
            q = q.where(s.template == template)
        if metadata:
            q = q.where(s.metadata.contains(metadata))
        if after is not None:
            q = q.where(sa.tuple_(s.created_at, s.id) < sa.tuple_(*after))
        q = q.order_by(s.created_at.desc(), s.id.desc()).limit(limit)
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def request(
        self,
        tenant_id: str,
        sandbox_id: str,
        desired: str,
        allowed_from: Sequence[str],
        verb: str,
        only_if_desired: str | None = None,
    ) -> Row:
        """Ask for a new desired state; Conflict unless the current state allows it."""
        s = t.sandboxes.c
        conditions = [
            s.id == sandbox_id,
            s.tenant_id == tenant_id,
            s.state.in_(allowed_from),
            # A delete once asked for is never taken back by a later request.
            s.desired_state != "deleted",
        ]
        if only_if_desired is not None:
            conditions.append(s.desired_state == only_if_desired)
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(*conditions)
                        .values(desired_state=desired, updated_at=sa.func.now())
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .first()
            )
            if row is None:
                current = await c.execute(
                    sa.select(s.state).where(s.id == sandbox_id, s.tenant_id == tenant_id)
                )
                state = current.scalar()
                if state is None:
                    raise NotFound(sandbox_id)
                raise Conflict(sandbox_id, state, verb)
            await self._event(c, row, "requested", row["state"], desired, None)
            await _notify(c, sandbox_id)
            return row

    async def set_network(self, tenant_id: str, sandbox_id: str, network: dict[str, Any]) -> Row:
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            q = (
                t.sandboxes.update()
                .where(s.id == sandbox_id, s.tenant_id == tenant_id)
                .values(network=network, updated_at=sa.func.now())
                .returning(*t.sandboxes.c)
            )
            row = (await c.execute(q)).mappings().first()
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def set_timeout(self, tenant_id: str, sandbox_id: str, timeout_s: int) -> Row:
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(s.id == sandbox_id, s.tenant_id == tenant_id)
                        .values(
                            timeout_s=timeout_s,
                            expires_at=sa.func.now() + timedelta(seconds=timeout_s),
                            updated_at=sa.func.now(),
                        )
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .first()
            )
        if row is None:
            raise NotFound(sandbox_id)
        return row

    async def transition(
        self,
        sandbox_id: str,
        from_states: Sequence[str],
        to_state: str,
        *,
        reason: str | None = None,
        **values: Any,
    ) -> Row | None:
        """Compare-and-set of `state`; None if the sandbox was not in `from_states`."""
        s = t.sandboxes.c
        async with self.engine.begin() as c:
            before = (
                await c.execute(sa.select(s.state).where(s.id == sandbox_id).with_for_update())
            ).scalar()
            if before is None or before not in from_states:
                return None
            if to_state == "running" and before != "running":
                # A sandbox's timeout runs from when it last started running.
                values.setdefault(
                    "expires_at",
                    sa.func.now() + sa.func.make_interval(0, 0, 0, 0, 0, 0, s.timeout_s),
                )
            row = (
                (
                    await c.execute(
                        t.sandboxes.update()
                        .where(s.id == sandbox_id)
                        .values(state=to_state, reason=reason, updated_at=sa.func.now(), **values)
                        .returning(*t.sandboxes.c)
                    )
                )
                .mappings()
                .one()
            )
            await self._event(c, row, "state", before, to_state, reason)
            await _notify(c, sandbox_id)
            return row

    async def sandboxes_to_reconcile(self, limit: int = 200) -> list[Row]:
        """Sandboxes whose state is not what was asked for (or is a transition under way)."""
        s = t.sandboxes.c
        q = (
            sa.select(t.sandboxes)
            .where(
                sa.or_(
                    s.state != s.desired_state,
                    s.state.in_(TRANSITIONAL),
                ),
                s.state != "deleted",
                sa.or_(s.state != "error", s.desired_state == "deleted"),
            )
            # Sandboxes waiting for room come last, so they never starve other work.
            .order_by(s.state == "pending", s.updated_at)
            .limit(limit)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def expired(self) -> list[Row]:
        s = t.sandboxes.c
        q = sa.select(t.sandboxes).where(
            s.expires_at < sa.func.now(),
            s.state == "running",
            s.desired_state == "running",
            sa.not_(s.pool),
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def on_worker(self, worker_id: str) -> list[Row]:
        q = sa.select(t.sandboxes).where(
            t.sandboxes.c.worker_id == worker_id, t.sandboxes.c.state != "deleted"
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    async def events(self, tenant_id: str, sandbox_id: str) -> list[Row]:
        q = (
            sa.select(t.events)
            .where(t.events.c.sandbox_id == sandbox_id, t.events.c.tenant_id == tenant_id)
            .order_by(t.events.c.id)
        )
        async with self.engine.connect() as c:
            return list((await c.execute(q)).mappings())

    @staticmethod
    async def _event(
        c: AsyncConnection,
        row: Row,
        kind: str,
        from_state: str | None,
        to_state: str | None,
        reason: str | None,
    ) -> None:
        await c.execute(
            t.events.insert().values(
                sandbox_id=row["id"],
                tenant_id=row["tenant_id"],
                type=kind,
                from_state=from_state,
                to_state=to_state,
                reason=reason,
            )
        )


async def _notify(c: AsyncConnection, sandbox_id: str) -> None:
    await c.execute(sa.select(sa.func.pg_notify(CHANNEL, sandbox_id)))


async def _attachments(c: AsyncConnection, volume_id: str) -> list[dict[str, Any]]:
    """Sandboxes not deleted that have the volume: id and whether read-only."""
    s = t.sandboxes.c
    q = sa.select(s.id, s.volumes).where(
        s.volumes.contains([{"volume": volume_id}]), s.state != "deleted"
    )
    out = []
    for row in await c.execute(q):
        for a in row.volumes:
            if a["volume"] == volume_id:
                out.append({"id": row.id, "read_only": bool(a.get("read_only", False))})
    return out


def _secret_context(tenant_id: str, name: str) -> str:
    # Bound into the ciphertext: a sealed value copied to another tenant's row does not open.
    return f"secret:{tenant_id}:{name}"

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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from space.db import tables as t

CHANNEL = "space_sandbox"
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


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str


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
        async with self.engine.begin() as c:
            existing = (
                await c.execute(sa.select(t.tenants).where(t.tenants.c.name == name))
            ).first()
            if existing:
                return Tenant(existing.id, existing.name)
            tid = new_id("tn")
            await c.execute(t.tenants.insert().values(id=tid, name=name))
            return Tenant(tid, name)

    async def create_api_key(self, tenant_id: str, name: str = "") -> str:
        """A new key; only its hash is stored, so this is the one time it can be seen."""
        key_id = secrets.token_hex(6)
        secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
        key = f"{KEY_PREFIX}{key_id}_{secret}"
        async with self.engine.begin() as c:
            await c.execute(
                t.api_keys.insert().values(
                    id=key_id, tenant_id=tenant_id, secret_sha256=_sha256(key), name=name
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
                    sa.select(t.api_keys.c.secret_sha256, t.tenants.c.id, t.tenants.c.name)
                    .join(t.tenants, t.tenants.c.id == t.api_keys.c.tenant_id)
                    .where(t.api_keys.c.id == key_id, t.api_keys.c.revoked_at.is_(None))
                )
            ).first()
        if row is None or not hmac.compare_digest(bytes(row.secret_sha256), _sha256(key)):
            return None
        return Tenant(row.id, row.name)

    # --- templates -----------------------------------------------------------------------------

    async def ensure_template(self, template_id: str) -> None:
        async with self.engine.begin() as c:
            await c.execute(pg_insert(t.templates).values(id=template_id).on_conflict_do_nothing())

    async def template_exists(self, template_id: str) -> bool:
        async with self.engine.connect() as c:
            q = sa.select(t.templates.c.id).where(t.templates.c.id == template_id)
            return (await c.execute(q)).first() is not None

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

    async def heartbeat(self, worker_id: str, instance: str) -> bool:
        """False if another process registered as this worker since (this one must stop)."""
        async with self.engine.begin() as c:
            res = await c.execute(
                t.workers.update()
                .where(t.workers.c.id == worker_id, t.workers.c.instance == instance)
                .values(heartbeat_at=sa.func.now(), state="active")
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

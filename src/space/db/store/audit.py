"""The audit trail: one entry per call that changed something through the control plane, or
tried to (space.api.audit records them). Entries are only ever added: the table's trigger
refuses UPDATE, DELETE and TRUNCATE (migration 0016)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONPATH

from space.db import tables as t
from space.db.store.base import Queries


@dataclass(frozen=True)
class AuditEntry:
    """Who (tenant, key), what (the route, its parameters, what it made), when, from where,
    and how it ended (the HTTP status it answered)."""

    tenant_id: str | None
    key_id: str | None
    admin: bool
    method: str
    action: str
    path: str
    status: int
    params: dict[str, str] = field(default_factory=dict)
    created: str | None = None
    request_id: str | None = None
    remote: str | None = None
    id: int = 0  # given by the database
    at: datetime | None = None

    @property
    def outcome(self) -> str:
        return "ok" if self.status < 400 else "refused" if self.status < 500 else "failed"


@dataclass(frozen=True)
class AuditQuery:
    """Which entries: those after `after` (an entry's id), oldest first, at most `limit`."""

    tenant_id: str | None = None  # None: every tenant's (an admin's question)
    after: int = 0
    limit: int = 100
    since: datetime | None = None
    until: datetime | None = None
    key_id: str | None = None
    subject: str | None = None  # an id the call named in its path or made
    action: str | None = None  # a part of the route, e.g. "/pause" or "DELETE"


class AuditQueries(Queries):
    async def record_audit(self, entry: AuditEntry) -> None:
        values = {
            "tenant_id": entry.tenant_id,
            "key_id": entry.key_id,
            "admin": entry.admin,
            "method": entry.method,
            "action": entry.action,
            "path": entry.path,
            "params": entry.params,
            "created": entry.created,
            "status": entry.status,
            "request_id": entry.request_id,
            "remote": entry.remote,
        }
        async with self.engine.begin() as c:
            await c.execute(t.audit_log.insert().values(**values))

    async def audit(self, q: AuditQuery) -> list[AuditEntry]:
        a = t.audit_log.c
        query = sa.select(t.audit_log).where(a.id > q.after).order_by(a.id).limit(q.limit)
        if q.tenant_id is not None:
            query = query.where(a.tenant_id == q.tenant_id)
        if q.since is not None:
            query = query.where(a.at >= q.since)
        if q.until is not None:
            query = query.where(a.at < q.until)
        if q.key_id is not None:
            query = query.where(a.key_id == q.key_id)
        if q.subject is not None:
            # A path parameter's value, passed as a variable: never spliced into the path.
            path = sa.cast(sa.literal("$.* ? (@ == $v)"), JSONPATH)
            named = sa.func.jsonb_path_exists(
                a.params, path, sa.func.jsonb_build_object("v", q.subject)
            )
            query = query.where(sa.or_(a.created == q.subject, named))
        if q.action is not None:
            query = query.where(a.action.contains(q.action, autoescape=True))
        async with self.engine.connect() as c:
            rows = (await c.execute(query)).mappings()
            return [AuditEntry(**row) for row in rows]

"""`GET /v1/audit`: the control plane's audit trail (written by `space.api.audit_trail`). A
tenant's key reads its tenant's entries, an admin key everyone's; `format=jsonl` streams the
entries as JSON lines, page by page, for export."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from space.api.deps import Caller, Services, Svc
from space.api.errors import APIError
from space.api.schemas import AuditPage, AuditRecord
from space.db.store import AuditQuery

router = APIRouter(prefix="/v1/audit", tags=["audit"])


@router.get("", response_model=AuditPage)
async def read_audit(
    svc: Svc,
    caller: Caller,
    after: Annotated[int, Query(ge=0, description="entries after this id")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    since: datetime | None = None,
    until: datetime | None = None,
    tenant: Annotated[str | None, Query(max_length=100, description="admins only")] = None,
    key: Annotated[str | None, Query(max_length=100)] = None,
    subject: Annotated[
        str | None, Query(max_length=200, description="an id the call named or made")
    ] = None,
    action: Annotated[
        str | None, Query(max_length=200, description='a part of the route, e.g. "/pause"')
    ] = None,
    format: Literal["json", "jsonl"] = "json",
) -> Any:
    """Oldest first. A tenant's key reads its tenant's entries; an admin key everyone's (or one
    tenant's). `format=jsonl` streams every entry that matches as JSON lines (`limit` is then
    the size of each page read)."""
    if tenant is not None and not caller.admin and tenant != caller.id:
        raise APIError(403, "only an admin key may read another tenant's audit log")
    query = AuditQuery(
        tenant_id=tenant if caller.admin else caller.id,
        after=after, limit=limit, since=since, until=until, key_id=key, subject=subject,
        action=action,
    )  # fmt: skip
    if format == "jsonl":
        return StreamingResponse(_lines(svc, query), media_type="application/jsonl")
    entries = await svc.store.audit(query)
    return AuditPage(
        items=[AuditRecord.model_validate(e) for e in entries],
        next=entries[-1].id if len(entries) == limit else None,
    )


async def _lines(svc: Services, query: AuditQuery) -> AsyncIterator[str]:
    while entries := await svc.store.audit(query):
        yield "".join(AuditRecord.model_validate(e).model_dump_json() + "\n" for e in entries)
        query = dataclasses.replace(query, after=entries[-1].id)

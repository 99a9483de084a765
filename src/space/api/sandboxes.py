"""Sandbox lifecycle routes: intent goes into the database; the controller carries it out."""

from __future__ import annotations

import base64
import binascii
import json
import secrets
import time
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from sqlalchemy.exc import IntegrityError

from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.metrics import CLAIMS, CREATE
from space.api.schemas import (
    AuditList,
    Event,
    EventList,
    NetworkUpdate,
    Sandbox,
    SandboxCreate,
    SandboxList,
    TimeoutUpdate,
)
from space.db.store import PoolMemberBroken, Row
from space.netpolicy import gateway_policy, placeholder_env, policy_for, with_placeholders
from space.worker.client import WorkerError

router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])

WAIT_S = 300.0
SETTLED = {"running", "paused", "suspended", "deleted", "error"}

Wait = Annotated[bool, Query(description="answer once the operation has finished")]


def _settled(row: Row) -> bool:
    return row["state"] in SETTLED and (
        row["state"] == row["desired_state"] or row["state"] in ("error", "deleted")
    )


def _cursor(row: Row) -> str:
    raw = json.dumps([row["created_at"].isoformat(), row["id"]]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _parse_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, sid = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return datetime.fromisoformat(created), str(sid)
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise APIError(
            400, "invalid cursor: pass back the next_cursor of a previous page"
        ) from None


@router.post("", status_code=201, response_model=Sandbox)
async def create_sandbox(
    body: SandboxCreate,
    svc: Svc,
    caller: Caller,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
    wait: Wait = True,
) -> Sandbox:
    """A running sandbox: claimed from the template's warm pool when one of this shape is
    ready (`boot` says "pool"), else restored from its base snapshot, else booted."""
    started = time.perf_counter()
    values = body.model_dump()
    values["idempotency_key"] = idempotency_key
    values["secrets"] = with_placeholders(body.secrets)
    # Every bound secret must be the caller's (404 names the missing one).
    secret_values = await svc.store.open_secrets(
        caller.id, sorted({b.secret for b in body.secrets}), svc.sealer
    )
    # A pool member has no volumes, and its id is not the client's. Only usable templates
    # have members, so a hit needs no look at the template.
    pooled = body.id is None and not body.volumes
    row = await _claim(svc, caller, values, secret_values) if pooled else None
    created = True
    if row is not None:
        CLAIMS.labels(body.template, "hit").inc()
    else:
        # Checked before any metric names it: labels only ever hold real template names.
        if not await svc.store.template_exists(body.template):
            raise APIError(404, f"no template {body.template!r}")
        if pooled:
            CLAIMS.labels(body.template, "miss").inc()
        values["id"] = body.id or f"sb-{secrets.token_hex(8)}"
        row, created = await svc.store.create_sandbox(caller.id, values)
        if wait:
            row = await svc.wait_for(row["id"], _settled, WAIT_S)
    if not created:
        response.status_code = 200
    elif row["state"] != "running" and not wait:
        response.status_code = 202
    if created and row["state"] == "running":
        CREATE.labels(row["template"], row["boot"] or "").observe(time.perf_counter() - started)
    return Sandbox.from_row(row)


async def _claim(
    svc: Svc, caller: Caller, values: dict[str, Any], secret_values: dict[str, str]
) -> Row | None:
    """A warm-pool member handed over to the caller, or None (a miss, or a repeated request)."""
    key = values["idempotency_key"]
    if key and await svc.store.by_idempotency_key(caller.id, key) is not None:
        return None  # the create path answers with the sandbox made the first time
    body = {
        "env": {**values["env"], **placeholder_env(values["secrets"])},
        "network": gateway_policy(values["network"], values["secrets"], secret_values).model_dump(),
    }

    async def personalise(member: Row, worker_url: str) -> None:
        try:
            await svc.workers.call("POST", f"{worker_url}/vms/{member['id']}/claim", json=body)
        except WorkerError as e:
            raise PoolMemberBroken(e.detail) from e

    try:
        return await svc.store.claim_pooled(caller.id, values, personalise)
    except IntegrityError:
        return None  # the same idempotency key raced us; the create path sorts it out


@router.get("/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: str, svc: Svc, caller: Caller) -> Sandbox:
    return Sandbox.from_row(await svc.store.get_sandbox(sandbox_id, caller.id))


@router.get("", response_model=SandboxList)
async def list_sandboxes(
    request: Request,
    svc: Svc,
    caller: Caller,
    state: str | None = None,
    template: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> SandboxList:
    metadata = {
        k[len("metadata.") :]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata.") and len(k) > len("metadata.")
    }
    rows = await svc.store.list_sandboxes(
        caller.id,
        state=state,
        template=template,
        metadata=metadata or None,
        limit=limit + 1,
        after=_parse_cursor(cursor) if cursor else None,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return SandboxList(
        items=[Sandbox.from_row(r) for r in rows],
        next_cursor=_cursor(rows[-1]) if more else None,
    )


async def _change(
    svc: Svc, caller: Caller, sandbox_id: str, desired: str, allowed: tuple[str, ...],
    verb: str, wait: bool,
) -> Sandbox:  # fmt: skip
    row = await svc.store.request(caller.id, sandbox_id, desired, allowed, verb)
    if wait:
        row = await svc.wait_for(sandbox_id, _settled, WAIT_S)
    return Sandbox.from_row(row)


@router.delete("/{sandbox_id}", response_model=Sandbox)
async def delete_sandbox(sandbox_id: str, svc: Svc, caller: Caller, wait: Wait = True) -> Sandbox:
    allowed = ("pending", "starting", "running", "pausing", "paused", "resuming", "suspending",
               "suspended", "error", "deleting")  # fmt: skip
    return await _change(svc, caller, sandbox_id, "deleted", allowed, "delete", wait)


@router.post("/{sandbox_id}/pause", response_model=Sandbox)
async def pause_sandbox(sandbox_id: str, svc: Svc, caller: Caller, wait: Wait = True) -> Sandbox:
    return await _change(svc, caller, sandbox_id, "paused", ("running",), "pause", wait)


@router.post("/{sandbox_id}/resume", response_model=Sandbox)
async def resume_sandbox(sandbox_id: str, svc: Svc, caller: Caller, wait: Wait = True) -> Sandbox:
    return await _change(
        svc, caller, sandbox_id, "running", ("paused", "suspended"), "resume", wait
    )


@router.post("/{sandbox_id}/suspend", response_model=Sandbox)
async def suspend_sandbox(sandbox_id: str, svc: Svc, caller: Caller, wait: Wait = True) -> Sandbox:
    return await _change(
        svc, caller, sandbox_id, "suspended", ("running", "paused"), "suspend", wait
    )


@router.put("/{sandbox_id}/timeout", response_model=Sandbox)
async def set_timeout(sandbox_id: str, body: TimeoutUpdate, svc: Svc, caller: Caller) -> Sandbox:
    return Sandbox.from_row(await svc.store.set_timeout(caller.id, sandbox_id, body.timeout_s))


@router.put("/{sandbox_id}/network", response_model=Sandbox)
async def set_network(sandbox_id: str, body: NetworkUpdate, svc: Svc, caller: Caller) -> Sandbox:
    """Change the egress policy; a running or paused sandbox gets it at once (its secret
    bindings stay as they are)."""
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    network = body.network.model_dump()
    if row["state"] in ("running", "paused") and row["worker_id"]:
        policy = await policy_for(svc.store, svc.sealer, row, network)
        worker = await svc.store.worker(row["worker_id"])
        if worker is None or worker["state"] != "active":
            raise APIError(503, f"sandbox {sandbox_id}'s worker is not available")
        await svc.workers.call(
            "PUT", f"{worker['url']}/vms/{sandbox_id}/network", json=policy.model_dump()
        )
    return Sandbox.from_row(await svc.store.set_network(caller.id, sandbox_id, network))


@router.get("/{sandbox_id}/audit", response_model=AuditList)
async def audit(sandbox_id: str, svc: Svc, caller: Caller, after: int = 0) -> AuditList:
    """Every egress decision the gateway made for this sandbox (allowed or denied, and why)."""
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    worker = await svc.store.worker(row["worker_id"]) if row["worker_id"] else None
    if worker is None:
        return AuditList(items=[])  # never placed: nothing was decided for it
    if worker["state"] != "active":
        raise APIError(503, f"worker {worker['id']}, which keeps its audit log, is not available")
    events = await svc.workers.call(
        "GET", f"{worker['url']}/vms/{sandbox_id}/audit", params={"after": after}
    )
    return AuditList(items=events["items"])


@router.get("/{sandbox_id}/events", response_model=EventList)
async def sandbox_events(sandbox_id: str, svc: Svc, caller: Caller) -> EventList:
    await svc.store.get_sandbox(sandbox_id, caller.id)  # 404 for others' sandboxes
    rows = await svc.store.events(caller.id, sandbox_id)
    return EventList(items=[Event.model_validate(dict(r)) for r in rows])

"""Sandbox lifecycle routes: intent goes into the database; the controller carries it out."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import IntegrityError

from space import crashpoints, logs, tracing
from space.api.data import ClosingStream
from space.api.deps import Caller, Services, Svc
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
from space.api.templates import fitted
from space.controller.placement import Need, pick_worker, why_not
from space.db.store import TRANSITIONAL, Conflict, NotFound, Refused, Row, Tenant
from space.netpolicy import gateway_policy, placeholder_env, policy_for, with_placeholders
from space.quotas import over
from space.worker.api.client import Worker, WorkerError
from space.worker.api.models import NDJSON, ClaimVM

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])

WAIT_S = 300.0
POLICY_WAIT_S = 10.0
RETRY_AFTER_S = 5
CLAIM_TRIES = 3
SETTLED = {"running", "paused", "suspended", "deleted", "error"}
STATE_PATTERN = "^(" + "|".join(sorted({*SETTLED, *TRANSITIONAL})) + ")$"

Wait = Annotated[bool, Query(description="answer once the operation has finished")]
RoomWait = Annotated[
    float,
    Query(ge=0, le=300, description="when no worker has room now, wait this many seconds for "
          "room before answering 503 (0: answer at once)"),
]  # fmt: skip
ROOM_RECHECK_S = 0.5
EVENTS_PAGE = 1000  # events read at once by a follower
EVENTS_RECHECK_S = 15.0  # a follower looks again this often even if nothing was announced
PLACE_GRACE_S = 5.0  # an admitted create may wait this long for placement to find its room


def _settled(row: Row) -> bool:
    return row["state"] in SETTLED and (
        row["state"] == row["desired_state"] or row["state"] in ("error", "deleted")
    )


def page_cursor(row: Row) -> str:
    raw = json.dumps([row["created_at"].isoformat(), row["id"]]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def parse_cursor(cursor: str) -> tuple[datetime, str]:
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
    room_wait_s: RoomWait = 0.0,
) -> Sandbox:
    """A running sandbox: claimed from the template's warm pool when one of this shape is
    ready (`boot` says "pool"), else restored from its base snapshot, else booted."""
    started = time.perf_counter()
    if body.network is not None:
        svc.check_egress(body.network)
    body = await _fit_template(svc, body, caller)
    values = body.model_dump()
    values["idempotency_key"] = idempotency_key
    values["request_id"] = logs.request_id.get()  # the controller's lines for it carry it on
    values["trace_parent"] = tracing.traceparent()  # and its spans join this request's trace
    values["secrets"] = with_placeholders(body.secrets)
    idle = svc.settings.idle_timeout_s if body.idle_timeout_s is None else body.idle_timeout_s
    values["idle_timeout_s"] = idle or None
    # Every bound secret must be the caller's (404 names the missing one).
    secret_values = await svc.store.open_secrets(
        caller.id, sorted({b.secret for b in body.secrets}), svc.sealer
    )
    # A pool member has no volumes, and its id is not the client's. Only usable templates
    # have members, so a hit needs no look at the template.
    pooled = body.id is None and not body.volumes
    if not await _repeated(svc, caller, body, idempotency_key):
        await _within_quota(svc, caller, body)
    row = await _claim(svc, caller, values, secret_values) if pooled else None
    created = True
    label = body.template  # of metrics: a template every tenant has (there are few of them)
    if row is not None:
        CLAIMS.labels(label, "hit").inc()
    else:
        # Checked before any metric names it: labels only ever hold real template names.
        usable = await svc.store.usable_template(body.template, caller.id)
        if usable is None:
            raise APIError(404, f"no template {body.template!r}")
        if usable == "own":  # one of a tenant's snapshots, of which there is no bound
            label = "(a tenant's own)"
        if pooled:
            CLAIMS.labels(label, "miss").inc()
        await _admit(svc, body, room_wait_s)
        values["id"] = chosen_id(body.id, caller.id) if body.id else f"sb-{secrets.token_hex(8)}"
        row, created = await svc.store.create_sandbox(caller.id, values, svc.settings.quotas)
        if wait and created:
            row = await _placed(svc, caller.id, row, room_wait_s)
        elif wait:  # a repeat: the first request decides whether to give it up
            row = await svc.wait_for(row["id"], _settled, WAIT_S)
    logs.bind(sandbox=row["id"], worker=row["worker_id"])
    log.info("sandbox %s is %s (boot %s)", row["id"], row["state"], row["boot"])
    if not created:
        response.status_code = 200
    elif row["state"] != "running" and not wait:
        response.status_code = 202
    if created and row["state"] == "running":
        CREATE.labels(label, row["boot"] or "").observe(time.perf_counter() - started)
    return Sandbox.from_row(row)


async def _fit_template(svc: Svc, body: SandboxCreate, caller: Tenant) -> SandboxCreate:
    """A create that names no disk size gets the default, or its template's size if that is
    larger; one of a template made from a checkpoint gets that checkpoint's shape, and 400 if
    it asks for another (`base` needs no look; another tenant's own template none either)."""
    if body.template == "base":
        return body
    record = await svc.store.template_record(body.template, caller.id)
    if record is None:
        return body
    return body.model_copy(update=fitted(record, body))


def chosen_id(chosen: str, tenant_id: str) -> str:
    """A client-chosen id, in its tenant's own space: `chosen` and a tag of the tenant. Two
    tenants choosing the same id get two sandboxes, and no create can tell whether an id is
    taken by another tenant (ids are global and never freed)."""
    return f"{chosen}-{hashlib.sha256(tenant_id.encode()).hexdigest()[:10]}"


async def _repeated(svc: Svc, caller: Caller, body: SandboxCreate, key: str | None) -> bool:
    """A repeat of a create that was made (its answer is that sandbox, whatever the quota)."""
    if key and await svc.store.by_idempotency_key(caller.id, key) is not None:
        return True
    if body.id is None:
        return False
    try:
        await svc.store.get_sandbox(chosen_id(body.id, caller.id), caller.id)
    except NotFound:
        return False
    return True


async def _within_quota(svc: Svc, caller: Caller, body: SandboxCreate) -> None:
    """429 at once for a create past the tenant's quotas, before a pool member is spent on it
    (the insert checks again with the tenant locked: this look takes no lock)."""
    quotas, used = await svc.store.quotas_of(caller.id, svc.settings.quotas)
    adding = {"sandboxes": 1, "vcpus": body.vcpus, "memory_mib": body.memory_mib,
              "disk_mib": body.disk_mib}  # fmt: skip
    if why := over(quotas, {k: used[k] + n for k, n in adding.items()}):
        raise APIError(429, why)


async def _placed(svc: Svc, tenant_id: str, row: Row, room_wait_s: float) -> Row:
    """The sandbox once it settled. One still waiting for room past its bound (what the
    client would wait, at least PLACE_GRACE_S) is given up, as it holds nothing yet, and
    answered 503 with why: the API's admission saw room that placement then did not find
    (members that gave less than they seemed to, a burst of creates), and a full platform
    must not leave a client hanging."""
    give_up = time.monotonic() + max(room_wait_s, PLACE_GRACE_S)

    def done(r: Row) -> bool:
        return _settled(r) or (_waiting_for_room(r) and time.monotonic() >= give_up)

    row = await svc.wait_for(row["id"], done, WAIT_S)
    if not _waiting_for_room(row):
        return row
    try:
        await svc.store.request(tenant_id, row["id"], "deleted", ("pending",), "delete",
                                reason="given up: no worker had room for it")  # fmt: skip
    except Conflict:  # placed meanwhile after all
        return await svc.wait_for(row["id"], _settled, WAIT_S)
    raise APIError(503, f"no worker can take this sandbox now: {row['reason']}",
                   headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip


def _waiting_for_room(row: Row) -> bool:
    return row["state"] == "pending" and (row["reason"] or "").startswith("waiting for")


async def _admit(svc: Svc, body: SandboxCreate, room_wait_s: float) -> None:
    """Refuse (503, with why) a sandbox that no worker could take now, rather than leave it
    waiting, or after `room_wait_s` if the client would wait that long for room: warm-pool
    members count as free room (they give way)."""
    deadline = time.monotonic() + room_wait_s
    need = Need(body.vcpus, body.memory_mib, body.disk_mib)
    while True:
        workers = await svc.store.workers()
        if home := await svc.store.template_worker(body.template):
            workers = [w for w in workers if w["id"] == home]
        load = await svc.store.worker_load()
        if pick_worker(workers, load, need, members_give_way=True) is not None:
            return
        if time.monotonic() + ROOM_RECHECK_S > deadline:
            why = why_not(workers, load, need, members_give_way=True)
            raise APIError(503, f"no worker can take this sandbox now: {why}",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        await asyncio.sleep(ROOM_RECHECK_S)


async def _claim(
    svc: Svc, caller: Caller, values: dict[str, Any], secret_values: dict[str, str]
) -> Row | None:
    """A warm-pool member handed over to the caller, or None (a miss, or a repeated request).

    A claim record, the worker's hand-over, then a confirmation (see `space.db.store.pools`);
    no transaction is open during the worker call, which has a deadline of its own."""
    key = values["idempotency_key"]
    if key and await svc.store.by_idempotency_key(caller.id, key) is not None:
        return None  # the create path answers with the sandbox made the first time
    body = ClaimVM(
        env={**values["env"], **placeholder_env(values["secrets"])},
        network=gateway_policy(
            values["network"], values["secrets"], secret_values, svc.settings.egress_default
        ),
    )
    for _ in range(CLAIM_TRIES):
        token = secrets.token_hex(12)
        member = await svc.store.claim_member(values, token)
        if member is None:
            return None
        crashpoints.reached("claim.after-record")
        worker = Worker(member["worker_id"], member["worker_url"])
        try:
            await svc.workers.claim_vm(worker, member["id"], body, member["epoch"])
        except WorkerError as e:
            log.warning("claim of member %s failed: %s", member["id"], e.detail)
            await svc.store.abandon_claim(member["id"], token, f"claim failed: {e.detail}")
            continue
        crashpoints.reached("claim.after-worker")
        try:
            row = await svc.store.confirm_claim(
                member["id"], token, caller.id, values, svc.settings.quotas
            )
        except Refused:  # past a quota after all (a concurrent create took the last of it)
            await svc.store.abandon_claim(member["id"], token, "over the tenant's quota")
            raise
        except IntegrityError:
            # The same idempotency key raced us: the create path answers with the other one.
            await svc.store.abandon_claim(member["id"], token, "a duplicate request")
            return None
        if row is not None:
            return row
    return None


@router.get("/{sandbox_id}", response_model=Sandbox)
async def get_sandbox(sandbox_id: str, svc: Svc, caller: Caller) -> Sandbox:
    return Sandbox.from_row(await svc.store.get_sandbox(sandbox_id, caller.id))


@router.get("", response_model=SandboxList)
async def list_sandboxes(
    request: Request,
    svc: Svc,
    caller: Caller,
    state: Annotated[str | None, Query(pattern=STATE_PATTERN)] = None,
    template: Annotated[str | None, Query(max_length=64, pattern=r"^[^\x00]*$")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    deleted: Annotated[bool, Query(description="false: leave deleted sandboxes out")] = True,
    id: Annotated[
        str | None, Query(max_length=100, pattern=r"^[A-Za-z0-9_.-]*$", description="an id's start")
    ] = None,
) -> SandboxList:
    metadata = {
        k[len("metadata.") :]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata.") and len(k) > len("metadata.")
    }
    if any("\0" in k or "\0" in v for k, v in metadata.items()):
        raise APIError(400, "metadata filters may not contain NUL bytes")
    rows = await svc.store.list_sandboxes(
        caller.id,
        state=state,
        template=template,
        metadata=metadata or None,
        limit=limit + 1,
        after=parse_cursor(cursor) if cursor else None,
        deleted=deleted,
        id_prefix=id,
    )
    more = len(rows) > limit
    rows = rows[:limit]
    return SandboxList(
        items=[Sandbox.from_row(r) for r in rows],
        next_cursor=page_cursor(rows[-1]) if more else None,
    )


async def _change(
    svc: Svc, caller: Caller, sandbox_id: str, desired: str, allowed: tuple[str, ...],
    verb: str, wait: bool,
) -> Sandbox:  # fmt: skip
    row = await svc.store.request(
        caller.id,
        sandbox_id,
        desired,
        allowed,
        verb,
        request_id=logs.request_id.get(),
        trace_parent=tracing.traceparent(),
    )
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
async def set_network(
    sandbox_id: str, body: NetworkUpdate, svc: Svc, caller: Caller, response: Response
) -> Sandbox:
    """Change the egress policy (its secret bindings stay as they are). A running or paused
    sandbox gets it at once: the answer comes once it is in force (202 if that takes longer
    than a few seconds; it is then in force as soon as its worker answers)."""
    svc.check_egress(body.network)
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    network = body.network.model_dump()
    # Its secrets still open (404 if not).
    await policy_for(svc.store, svc.sealer, row, svc.settings.egress_default, network)
    row = await svc.store.set_network(
        caller.id,
        sandbox_id,
        network,
        request_id=logs.request_id.get(),
        trace_parent=tracing.traceparent(),
    )
    if row["state"] in ("running", "paused"):
        version = row["network_version"]

        def in_force(r: Row) -> bool:
            return bool(r["network_applied"] >= version or r["state"] not in ("running", "paused"))

        row = await svc.wait_for(sandbox_id, in_force, POLICY_WAIT_S)
        if row["network_applied"] < version and row["state"] in ("running", "paused"):
            response.status_code = 202
    return Sandbox.from_row(row)


@router.get("/{sandbox_id}/audit", response_model=AuditList)
async def audit(sandbox_id: str, svc: Svc, caller: Caller, after: int = 0) -> AuditList:
    """Every egress decision the gateway made for this sandbox (allowed or denied, and why)."""
    row = await svc.store.get_sandbox(sandbox_id, caller.id)
    if row["worker_id"] is None:
        return AuditList(items=[])  # never placed: nothing was decided for it
    worker = await svc.worker_of(row)
    return AuditList(items=(await svc.workers.audit(worker, sandbox_id, after)).items)


@router.get("/{sandbox_id}/events", response_model=EventList)
async def sandbox_events(
    sandbox_id: str,
    svc: Svc,
    caller: Caller,
    after: Annotated[
        int, Query(ge=0, le=2**63 - 1, description="only events numbered after this")
    ] = 0,
    follow: Annotated[bool, Query(description="NDJSON, one event a line, as they happen")] = False,
) -> EventList | StreamingResponse:
    """Its lifecycle events, oldest first. With `follow`, an NDJSON stream of them that goes on
    as they happen (pushed as the database announces each change) until it is deleted or the
    caller leaves; reconnect with `after` set to the last `id` seen."""
    await svc.store.get_sandbox(sandbox_id, caller.id)  # 404 for others' sandboxes
    if follow:
        answer = ClosingStream(_follow_events(svc, caller.id, sandbox_id, after), NDJSON,
                               contextlib.AsyncExitStack())  # fmt: skip
        answer.on_close(svc.follow(caller.id))
        return answer
    rows = await svc.store.events(caller.id, sandbox_id, after)
    return EventList(items=[Event.model_validate(dict(r)) for r in rows])


async def _follow_events(
    svc: Services, tenant_id: str, sandbox_id: str, after: int
) -> AsyncIterator[bytes]:
    changed = svc.listener.subscribe(sandbox_id)
    try:
        while True:
            changed.clear()
            # Read before its events: once deleted, every event it will have is among them.
            gone = (await svc.store.get_sandbox(sandbox_id, tenant_id))["state"] == "deleted"
            rows = await svc.store.events(tenant_id, sandbox_id, after, EVENTS_PAGE)
            for row in rows:
                after = row["id"]
                yield Event.model_validate(dict(row)).model_dump_json().encode() + b"\n"
            if len(rows) == EVENTS_PAGE:
                continue
            if gone:
                return
            # A missed announcement (the listener reconnecting) costs a recheck, not the event.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), EVENTS_RECHECK_S)
    finally:
        svc.listener.unsubscribe(changed, sandbox_id)

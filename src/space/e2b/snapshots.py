"""E2B's snapshots: a running sandbox's state (memory, processes and disk) kept as a template
that only its tenant sees, so `Sandbox.create(template=snapshot)` starts sandboxes as it was.

Underneath, SPACE's own parts: a checkpoint of the sandbox (it runs on, paused briefly), a
template made of that checkpoint on its worker (which keeps clones of its files: it outlives
the sandbox), then the checkpoint is let go. A named snapshot is the tenant's under that name
(another snapshot of the same name replaces it, as under E2B); its template's id carries a
tag of the tenant, as client-chosen sandbox ids do, so two tenants' names never meet."""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import Field

from space.api import checkpoints
from space.api.checkpoints import CheckpointCreate
from space.api.deps import Svc
from space.api.errors import APIError
from space.api.sandboxes import chosen_id, page_cursor, parse_cursor
from space.db.store import NotFound, Refused, Row, Tenant
from space.db.store.templates import Snapshot
from space.e2b.rest import MAX_PAGE, E2BCaller, Lenient, alive
from space.worker.api.client import WorkerError

log = logging.getLogger(__name__)
router = APIRouter(tags=["e2b"])

BUILD_WAIT_S = 600.0  # how long a snapshot's answer waits for its template to be made
NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,52}$")  # with the tenant's tag, a template id


class SnapshotRequest(Lenient):
    name: str | None = Field(None, max_length=200)
    memory: bool | None = None


def info(row: Row) -> dict[str, Any]:
    return {"snapshotID": row["id"], "names": [row["label"]] if row["label"] else []}


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(
    sandbox_id: str, body: SnapshotRequest, svc: Svc, who: E2BCaller
) -> dict[str, Any]:
    """Answered once sandboxes can be made of it. It counts against the tenant's checkpoint
    quotas as the checkpoint it was made of would."""
    if body.memory is False:
        raise APIError(400, "filesystem-only snapshots are not supported: SPACE's snapshots "
                            "keep the sandbox's memory and running processes")  # fmt: skip
    if body.name is not None and not NAME.fullmatch(body.name):
        raise APIError(400, f"name {body.name!r} must match {NAME.pattern}")
    row = await alive(svc, who, sandbox_id)
    if row["state"] != "running":
        raise APIError(409, f"sandbox {sandbox_id} is {row['state']}, not running")
    if row["volumes"]:
        raise APIError(400, f"sandbox {sandbox_id} has volumes: a snapshot's sandboxes would "
                            "not have them")  # fmt: skip
    template_id = chosen_id(body.name, who.id) if body.name else f"snap-{secrets.token_hex(8)}"
    taken = await checkpoints.create_checkpoint(
        sandbox_id, svc, who, CheckpointCreate(name=f"snapshot {template_id}")
    )
    # The checkpoint goes however this ends: the template keeps clones of what it needs, and a
    # build still queued when it goes fails (nothing is left counting against the quotas).
    try:
        checkpoint, _, _ = await svc.store.checkpoint(who.id, sandbox_id, taken.id)
        await svc.store.request_build(
            template_id, secrets.token_hex(8), "", b"", None, checkpoint, tenant_id=who.id,
            private=Snapshot(who.id, sandbox_id, body.name, taken.size_bytes),
        )  # fmt: skip
        made = await svc.wait_for_template(
            template_id, lambda r: r["state"] in ("ready", "failed"), BUILD_WAIT_S
        )
    except Refused as e:
        raise APIError(e.status, str(e)) from None
    finally:
        await _let_go(svc, who, sandbox_id, taken.id)
    if made["state"] == "ready":
        return info(made)
    if made["record"] is None:  # never made: nothing of it is kept
        with contextlib.suppress(Refused):
            await svc.store.delete_template(template_id)
    if made["state"] != "failed":
        raise APIError(503, f"snapshot {template_id} took longer than {BUILD_WAIT_S:.0f} s: "
                            "take it again", headers={"Retry-After": "30"})  # fmt: skip
    raise APIError(500, f"snapshot {template_id} failed: {made['error']}")


async def _let_go(svc: Svc, who: Tenant, sandbox_id: str, checkpoint_id: str) -> None:
    """The snapshot's checkpoint, once its template holds what it needs (or failed)."""
    try:
        await checkpoints.delete_checkpoint(sandbox_id, checkpoint_id, svc, who)
    except (APIError, NotFound, WorkerError) as e:
        # The sandbox went meanwhile (its checkpoints with it), or its worker did not answer
        # (the checkpoint is then the tenant's to see and delete).
        log.warning("checkpoint %s of a snapshot not deleted: %s", checkpoint_id, e)


@router.get("/snapshots")
async def list_snapshots(
    svc: Svc,
    who: E2BCaller,
    response: Response,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID", max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=200)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=512)] = None,
) -> list[dict[str, Any]]:
    """The caller's snapshots, oldest first (of one sandbox; of one name or id)."""
    after = parse_cursor(next_token) if next_token else None
    rows = await svc.store.snapshots(who.id, limit + 1, sandbox_id=sandbox_id, name=name,
                                     after=after)  # fmt: skip
    if len(rows) > limit:
        rows = rows[:limit]
        response.headers["x-next-token"] = page_cursor(rows[-1])
    return [info(r) for r in rows]


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, svc: Svc, who: E2BCaller) -> Response:
    """One of the caller's snapshots (404 for any other template): refused (409) while a
    sandbox of it is alive."""
    rows = await svc.store.templates(template_id, who.id)
    if not rows or rows[0]["tenant_id"] != who.id:
        raise APIError(404, f"snapshot {template_id} not found")
    try:
        await svc.store.delete_template(template_id)
    except Refused as e:
        raise APIError(e.status, str(e)) from None
    return Response(status_code=204)

"""Template routes: what every tenant may start from, how it is built, and its warm pool.

Templates are shared by every tenant, so building, deleting and sizing pools take an admin key.
A template is built on one worker (a build needs VMs) and lives there: sandboxes of it are
placed on that worker.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from space.api.data import relay
from space.api.deps import Caller, Services, Svc, require_admin
from space.api.errors import APIError
from space.api.schemas import (
    TEMPLATE_ID,
    BuildRequest,
    CheckpointRef,
    PoolSettings,
    SandboxCreate,
    Template,
    TemplateList,
)
from space.db.store import NotFound, Row, Tenant
from space.db.store.templates import build_context
from space.worker.api.client import Worker
from space.worker.templates.dockerfile import dockerfile_spec
from space.worker.templates.errors import SpecError
from space.worker.templates.record import shape_error

router = APIRouter(prefix="/v1/templates", tags=["templates"])

START_WAIT_S = 30.0  # a queued build is answered once a worker started it, or after this
TEMPLATE_ID_RE = re.compile(TEMPLATE_ID)


def fitted(record: dict[str, Any], body: SandboxCreate | PoolSettings) -> dict[str, int]:
    """What a sandbox or pool member of the template that `record` describes gets where
    `body` names nothing: its file system's size where that is larger than the default disk,
    and the shape of the checkpoint it was made of, if it was (400 for another shape)."""
    named, update = body.model_fields_set, {}
    size_mib = -(-int(record["size_bytes"]) // (1 << 20))
    if "disk_mib" not in named and size_mib > body.disk_mib:
        update["disk_mib"] = size_mib
    if record.get("vcpus") is not None:
        update |= {f: record[f] for f in ("vcpus", "memory_mib") if f not in named}
        shape = {"vcpus": body.vcpus, "memory_mib": body.memory_mib} | update
        if why := shape_error(record, shape["vcpus"], shape["memory_mib"]):
            raise APIError(400, why)
    return update


async def _template(svc: Services, template_id: str, caller: Tenant) -> Row:
    """One the caller sees (an admin: any)."""
    rows = await svc.store.templates(template_id, None if caller.admin else caller.id)
    if not rows:
        raise APIError(404, f"no template {template_id!r}")
    return rows[0]


@router.get("", response_model=TemplateList)
async def list_templates(svc: Svc, caller: Caller) -> TemplateList:
    """Every template the caller may start sandboxes of (every tenant's and its own; an admin
    sees all); how each was built (its environment, steps, commands) only for admins."""
    rows = await svc.store.templates(tenant_id=None if caller.admin else caller.id)
    return TemplateList(items=[Template.from_row(r, admin=caller.admin) for r in rows])


@router.get("/{template_id}", response_model=Template)
async def get_template(template_id: str, svc: Svc, caller: Caller) -> Template:
    return Template.from_row(await _template(svc, template_id, caller), admin=caller.admin)


@router.post("/{template_id}/builds", status_code=202, response_model=Template)
async def build(template_id: str, body: BuildRequest, svc: Svc, caller: Caller) -> Template:
    """Build (or rebuild) a template from a space.toml or a Dockerfile (built as the spec it
    becomes); follow it at .../build/log. Steps
    whose inputs did not change since an earlier build on that worker come from its cache.
    The build is queued; the controller starts it on a worker with room (the template's own
    worker for a rebuild). Or make it of one of your checkpoints (on that checkpoint's
    worker): sandboxes of it start as the checkpoint was, processes running, with its shape."""
    require_admin(caller, "build templates")
    if not TEMPLATE_ID_RE.fullmatch(template_id):
        raise APIError(400, f"template id {template_id!r} must match {TEMPLATE_ID}")
    if template_id == "base":
        raise APIError(409, "base is the platform's own template (space image base)")
    try:
        context = base64.b64decode(body.context, validate=True)
    except binascii.Error:
        raise APIError(400, "context must be base64 (of a tar archive)") from None
    sealed = None
    if body.environ:
        sealed = svc.sealer.seal(json.dumps(body.environ).encode(), build_context(template_id))
    spec = body.spec
    if body.dockerfile:  # built as the spec it says: its steps, cache and log are a spec's
        try:
            spec = dockerfile_spec(body.dockerfile, template_id, body.build_args,
                                   insecure=body.insecure)  # fmt: skip
        except SpecError as e:
            raise APIError(400, str(e)) from None
    checkpoint = await _checkpoint(svc, caller, body.checkpoint) if body.checkpoint else None
    await svc.store.request_build(template_id, secrets.token_hex(8), spec, context, sealed,
                                  checkpoint, tenant_id=caller.id)  # fmt: skip
    row = await svc.wait_for_template(template_id, lambda r: r["state"] != "queued", START_WAIT_S)
    if row["state"] in ("ready", "failed") and row["error"]:
        # Its worker refused to start it (a bad spec or context): nothing was built.
        raise APIError(400, row["error"])
    return Template.from_row(row, admin=True)


async def _checkpoint(svc: Services, caller: Caller, ref: CheckpointRef) -> Row:
    """One of the caller's ready checkpoints, of a sandbox without volumes."""
    what = f"checkpoint {ref.checkpoint_id} of sandbox {ref.sandbox_id}"
    try:
        row, _, _ = await svc.store.checkpoint(caller.id, ref.sandbox_id, ref.checkpoint_id)
        sandbox = await svc.store.get_sandbox(ref.sandbox_id, caller.id)
    except NotFound:
        raise APIError(404, f"no {what}") from None
    if row["state"] != "ready":
        raise APIError(409, f"{what} is {row['state']}", state=row["state"])
    if sandbox["volumes"]:
        raise APIError(400, f"sandbox {ref.sandbox_id} has volumes: its checkpoints have them "
                       "mounted, and a template's sandboxes would not")  # fmt: skip
    return row


@router.get("/{template_id}/build/log", response_class=StreamingResponse)
async def build_log(template_id: str, svc: Svc, caller: Caller) -> StreamingResponse:
    """The last build's log as plain text, streamed until the build ends."""
    require_admin(caller, "read build logs")
    row = await _template(svc, template_id, caller)
    worker = await svc.store.worker(row["worker_id"]) if row["worker_id"] else None
    if row["build_id"] is None or worker is None:
        raise APIError(404, f"template {template_id} has no build log")
    if worker["state"] != "active":
        raise APIError(503, f"worker {worker['id']}, which ran the build, is not available")
    log = svc.workers.build_log(Worker(worker["id"], worker["url"]), row["build_id"])
    return await relay(log, "text/plain; charset=utf-8")


@router.delete("/{template_id}", response_model=Template)
async def delete_template(template_id: str, svc: Svc, caller: Caller) -> Template:
    """Refused while a sandbox (not deleted) uses it; its warm pool is let go."""
    require_admin(caller, "delete templates")
    await svc.store.delete_template(template_id)
    return Template.from_row(await _template(svc, template_id, caller), admin=True)


@router.put("/{template_id}/pool", response_model=Template)
async def set_pool(template_id: str, body: PoolSettings, svc: Svc, caller: Caller) -> Template:
    """Size and shape of the template's warm pool (admin keys only). The controller fills or
    shrinks it in the background; members of another shape are let go."""
    require_admin(caller, "change a warm pool")
    record = await svc.store.template_record(template_id)
    if record is not None:
        body = body.model_copy(update=fitted(record, body))
    try:
        await svc.store.set_pool(template_id, body.size, body.vcpus, body.memory_mib,
                                 body.disk_mib)  # fmt: skip
    except NotFound:
        raise APIError(404, f"no template {template_id!r}") from None
    return Template.from_row(await _template(svc, template_id, caller), admin=True)

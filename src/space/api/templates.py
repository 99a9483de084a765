"""Template routes: what every tenant may start from, how it is built, and its warm pool.

Templates are shared by every tenant, so building, deleting and sizing pools take an admin key.
A template is built on one worker (a build needs VMs) and lives there: sandboxes of it are
placed on that worker.
"""

from __future__ import annotations

import re

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from space.api.data import relay
from space.api.deps import Caller, Services, Svc
from space.api.errors import APIError
from space.api.schemas import TEMPLATE_ID, BuildRequest, PoolSettings, Template, TemplateList
from space.controller.placement import pick_worker
from space.db.store import NotFound, Row, Tenant

router = APIRouter(prefix="/v1/templates", tags=["templates"])

BUILD_VCPUS, BUILD_MEMORY_MIB = 1, 512  # what a build VM holds on its worker
TEMPLATE_ID_RE = re.compile(TEMPLATE_ID)


def _admin(caller: Tenant, what: str) -> None:
    if not caller.admin:
        raise APIError(403, f"only an admin key may {what}")


async def _template(svc: Services, template_id: str) -> Row:
    rows = await svc.store.templates(template_id)
    if not rows:
        raise APIError(404, f"no template {template_id!r}")
    return rows[0]


@router.get("", response_model=TemplateList)
async def list_templates(svc: Svc, caller: Caller) -> TemplateList:
    return TemplateList(items=[Template.from_row(r) for r in await svc.store.templates()])


@router.get("/{template_id}", response_model=Template)
async def get_template(template_id: str, svc: Svc, caller: Caller) -> Template:
    return Template.from_row(await _template(svc, template_id))


@router.post("/{template_id}/builds", status_code=202, response_model=Template)
async def build(template_id: str, body: BuildRequest, svc: Svc, caller: Caller) -> Template:
    """Build (or rebuild) a template from a space.toml; follow it at .../build/log. Steps
    whose inputs did not change since an earlier build on that worker come from its cache."""
    _admin(caller, "build templates")
    if not TEMPLATE_ID_RE.match(template_id):
        raise APIError(400, f"template id {template_id!r} must match {TEMPLATE_ID}")
    if template_id == "base":
        raise APIError(409, "base is the platform's own template (space image base)")
    existing = await svc.store.templates(template_id)
    if existing and existing[0]["state"] in ("building", "deleting"):
        raise APIError(409, f"template {template_id} is {existing[0]['state']}",
                       state=existing[0]["state"])  # fmt: skip
    workers = [w for w in await svc.store.workers() if w["state"] == "active"]
    home = existing[0]["worker_id"] if existing else None
    if home is not None:
        # Its sandboxes and its build cache are there: a rebuild stays on that worker.
        workers = [w for w in workers if w["id"] == home]
    worker_id = pick_worker(workers, await svc.store.worker_load(), BUILD_VCPUS, BUILD_MEMORY_MIB)
    if worker_id is None:
        why = f"worker {home}, which holds the template, is not available" if home else ""
        raise APIError(503, why or "no worker has room for a build now")
    url = next(w["url"] for w in workers if w["id"] == worker_id)
    started = await svc.workers.call(
        "POST", f"{url}/templates/{template_id}/builds", json=body.model_dump()
    )
    await svc.store.begin_build(template_id, worker_id, started["id"])
    return Template.from_row(await _template(svc, template_id))


@router.get("/{template_id}/build/log", response_class=StreamingResponse)
async def build_log(template_id: str, svc: Svc, caller: Caller) -> StreamingResponse:
    """The last build's log as plain text, streamed until the build ends."""
    _admin(caller, "read build logs")
    row = await _template(svc, template_id)
    worker = await svc.store.worker(row["worker_id"]) if row["worker_id"] else None
    if row["build_id"] is None or worker is None:
        raise APIError(404, f"template {template_id} has no build log")
    if worker["state"] != "active":
        raise APIError(503, f"worker {worker['id']}, which ran the build, is not available")
    return await relay(svc, "GET", f"{worker['url']}/builds/{row['build_id']}/log",
                       "text/plain; charset=utf-8")  # fmt: skip


@router.delete("/{template_id}", response_model=Template)
async def delete_template(template_id: str, svc: Svc, caller: Caller) -> Template:
    """Refused while a sandbox (not deleted) uses it; its warm pool is let go."""
    _admin(caller, "delete templates")
    await svc.store.delete_template(template_id)
    return Template.from_row(await _template(svc, template_id))


@router.put("/{template_id}/pool", response_model=Template)
async def set_pool(template_id: str, body: PoolSettings, svc: Svc, caller: Caller) -> Template:
    """Size and shape of the template's warm pool (admin keys only). The controller fills or
    shrinks it in the background; members of another shape are let go."""
    _admin(caller, "change a warm pool")
    try:
        await svc.store.set_pool(template_id, body.size, body.vcpus, body.memory_mib,
                                 body.disk_mib)  # fmt: skip
    except NotFound:
        raise APIError(404, f"no template {template_id!r}") from None
    return Template.from_row(await _template(svc, template_id))

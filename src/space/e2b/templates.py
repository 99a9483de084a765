"""E2B's template builder (`Template.build`, `build_in_background`, `get_build_status`,
`exists`): a template of the caller's tenant alone, built as the spec its steps make
(`e2b/template_spec.py`) by SPACE's builder, its steps cached as any spec's. Building takes an
admin key, as SPACE's own builds do: a build pulls its image from the worker's host.

The SDK asks for a build (`POST /v3/templates`), asks for each COPY whether its files are here
(`GET .../files/{hash}`) and uploads those that are not to the URL it is given (its own token
in it: the SDK sends no key there), starts the build with its steps (`POST /v2/templates/{id}
/builds/{build}`), then polls its status and log. The template is under its name as snapshots
are (`Sandbox.create(template=name)` finds it)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from pydantic import Field

from space.api.deps import Svc, require_admin
from space.api.errors import APIError
from space.api.sandboxes import chosen_id
from space.db.store import Row, Tenant
from space.db.store.templates import Snapshot, build_context
from space.e2b.rest import E2BCaller, Lenient
from space.e2b.template_spec import FILES_HASH, StartBuild, build_files, steps_spec
from space.worker.api.client import Worker

router = APIRouter(tags=["e2b"])

NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,51}$")  # with the tenant's tag, a template name
LOG_WAIT_S = 0.3  # a status poll reads the log its worker has, for this long at most
LOG_DONE_S = 10.0  # and an ended build's whole log
MAX_LOG_LINES = 100


class BuildAsk(Lenient):
    name: str | None = Field(None, max_length=200)
    alias: str | None = Field(None, max_length=200)
    tags: list[str] = Field(default_factory=list, max_length=16)
    cpu_count: int | None = Field(None, alias="cpuCount")
    memory_mb: int | None = Field(None, alias="memoryMB")


def _own(who: Tenant, template_id: str) -> str:
    """The name of one of the caller's templates by its id (404 for anyone else's)."""
    name, _, _ = template_id.rpartition("-")
    if not NAME.fullmatch(name) or chosen_id(name, who.id) != template_id:
        raise APIError(404, f"template {template_id} not found")
    return name


def _check_hash(files_hash: str) -> None:
    if not FILES_HASH.fullmatch(files_hash):
        raise APIError(400, "a files hash is 64 lower-case hex digits")


@router.post("/v3/templates", status_code=202)
@router.post("/v2/templates", status_code=202, include_in_schema=False)
async def ask_build(body: BuildAsk, who: E2BCaller) -> dict[str, Any]:
    """A build's ids; nothing is built before its steps come."""
    require_admin(who, "build templates")
    name = body.name or body.alias
    if name is None:
        raise APIError(400, "a template build needs a name")
    name, _, tag = name.partition(":")
    if tag or body.tags:
        raise APIError(400, "template tags are not supported: SPACE keeps the last build of a "
                            "name")  # fmt: skip
    if not NAME.fullmatch(name):
        raise APIError(400, f"name {name!r} must match {NAME.pattern}")
    return {"templateID": chosen_id(name, who.id), "buildID": str(uuid.uuid4()),
            "public": False, "names": [name], "aliases": [name], "tags": []}  # fmt: skip


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
async def files(template_id: str, files_hash: str, request: Request, svc: Svc,
                who: E2BCaller) -> dict[str, Any]:  # fmt: skip
    """Whether a COPY step's files are here, and where to upload them if not."""
    require_admin(who, "build templates")
    _own(who, template_id)
    _check_hash(files_hash)
    token = await svc.store.want_upload(who.id, files_hash)
    if token is None:
        return {"present": True}
    url = request.url_for("upload", template_id=template_id, files_hash=files_hash)
    return {"present": False, "url": str(url.include_query_params(token=token))}


@router.put("/templates/{template_id}/files/{files_hash}", status_code=201, name="upload")
async def upload(
    template_id: str, files_hash: str, token: Annotated[str, Query(max_length=64)],
    request: Request, svc: Svc,
) -> Response:  # fmt: skip
    """The upload itself: its URL's token is its authority, checked before the body is read
    (the API caps its size)."""
    _check_hash(files_hash)
    tenant_id = await svc.store.upload_owner(files_hash, token)
    if tenant_id is None:
        raise APIError(403, f"no upload of {files_hash} is asked for with this URL")
    await svc.store.put_upload(tenant_id, files_hash, token, await request.body())
    return Response(status_code=201)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
async def start_build(
    template_id: str, build_id: str, body: StartBuild, svc: Svc, who: E2BCaller
) -> Response:
    require_admin(who, "build templates")
    name = _own(who, template_id)
    if len(build_id) > 64:
        raise APIError(400, "a build id is at most 64 characters")
    spec, environ = steps_spec(template_id, body)
    hashes = [s.files_hash for s in body.steps if s.files_hash]
    uploaded = await svc.store.uploads(who.id, hashes)
    context = await asyncio.to_thread(build_files, uploaded, hashes)  # CPU: off the loop
    sealed = None
    if environ:
        sealed = svc.sealer.seal(json.dumps(environ).encode(), build_context(template_id))
    own = Snapshot(who.id, None, name, 0)
    await svc.store.request_build(template_id, build_id, spec, context, sealed,
                                  tenant_id=who.id, private=own)  # fmt: skip
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(
    template_id: str, build_id: str, svc: Svc, who: E2BCaller,
    logs_offset: Annotated[int, Query(alias="logsOffset", ge=0)] = 0,
    limit: Annotated[int, Query(ge=0, le=MAX_LOG_LINES)] = MAX_LOG_LINES,
) -> dict[str, Any]:  # fmt: skip
    _own(who, template_id)
    rows = await svc.store.templates(template_id, who.id)
    if not rows:
        raise APIError(404, f"template {template_id} has no build")
    row = rows[0]
    # The last build's error, even where an earlier build is still there to start sandboxes
    # of (its state then stays "ready"); a queued build has no log yet, not the last one's.
    state = (
        "error"
        if row["error"]
        else {"ready": "ready", "failed": "error"}.get(row["state"], "building")
    )
    lines = [] if row["state"] == "queued" else await _log(svc, row)
    entries = [_entry(line) for line in lines[logs_offset : logs_offset + limit]]
    status: dict[str, Any] = {"templateID": template_id, "buildID": build_id, "status": state,
              "logEntries": entries, "logs": []}  # fmt: skip
    if state == "error":  # the SDK reads a reason that is there, and takes no null
        status["reason"] = {"message": row["error"] or "the build failed"}
    return status


@router.get("/templates/aliases/{alias}")
async def alias(alias: str, svc: Svc, who: E2BCaller) -> dict[str, Any]:
    """Whether the caller can start sandboxes of a template of that name (E2B's `exists`)."""
    if not NAME.fullmatch(alias):
        raise APIError(404, f"no template {alias!r}")
    for template_id in (chosen_id(alias, who.id), alias):
        if await svc.store.usable_template(template_id, who.id):
            return {"templateID": template_id, "public": template_id == alias}
    raise APIError(404, f"no template {alias!r}")


async def _log(svc: Svc, row: Row) -> list[str]:
    """The lines of the template's last build log its worker has now (none before it runs)."""
    worker = await svc.store.worker(row["worker_id"]) if row["worker_id"] else None
    if row["build_id"] is None or worker is None or worker["state"] != "active":
        return []
    text = b""
    # A build under way is read for what its worker has now; an ended one's log ends by itself.
    wait = LOG_WAIT_S if row["state"] == "building" else LOG_DONE_S
    with contextlib.suppress(Exception):  # a log that cannot be read is an empty one
        async with svc.workers.build_log(Worker(worker["id"], worker["url"]), row["build_id"]) as r:
            deadline = time.monotonic() + wait  # from the answer: opening it is not reading it
            chunks = r.aiter_bytes()
            while (left := deadline - time.monotonic()) > 0:
                try:
                    text += await asyncio.wait_for(anext(chunks), left)
                except (StopAsyncIteration, TimeoutError):
                    break
    # A last line without its newline may still grow: it waits for the next poll.
    return text.decode(errors="replace").split("\n")[:-1]


def _entry(line: str) -> dict[str, Any]:
    level = "error" if "build failed" in line else "info"
    return {"timestamp": datetime.now(UTC).isoformat(), "level": level, "message": line}

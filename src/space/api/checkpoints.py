"""Checkpoints, rollbacks and forks of a running sandbox.

Each is a record, the sandbox's worker's call (with the leader's epoch and a deadline; no
transaction is open meanwhile), then a confirmation (see `space.db.store.checkpoints`). The
sandbox's state does not change: it runs throughout (paused briefly while it is snapshotted).
Volumes are not in checkpoints and are never rolled back.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field, field_validator

from space import logs, tracing
from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.schemas import FromRow, Sandbox, Strict, _check_env
from space.db.store import NotFound, Refused, Row
from space.netpolicy import placeholder_env, policy_for
from space.worker.api.client import Worker, WorkerError
from space.worker.api.models import MAX_FORK, ForkChild, ForkVM

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/sandboxes", tags=["checkpoints"])

Metadata = dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=512)]]


class CheckpointCreate(Strict):
    name: str = Field("", max_length=128, pattern=r"^[^\x00]*$", description="yours, any text")


class Checkpoint(FromRow):
    id: str
    sandbox_id: str
    name: str
    state: str = Field(description="creating, ready or deleting")
    size_bytes: int = Field(description="what it holds on its worker's pool (memory and disk)")
    paused_ms: float | None = Field(description="how long the sandbox was paused to take it")
    created_at: datetime


class CheckpointList(BaseModel):
    items: list[Checkpoint]


class ForkCreate(Strict):
    count: int = Field(1, ge=1, le=MAX_FORK, description="how many children")
    checkpoint: str | None = Field(
        None, max_length=64, description="one of the sandbox's checkpoints, instead of its state"
    )
    env: dict[str, str] = Field(default_factory=dict, description="over the parent's env")
    metadata: Metadata = Field(default_factory=dict, description="the children's (not inherited)")

    @field_validator("env")
    @classmethod
    def env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)


class Forked(BaseModel):
    items: list[Sandbox] = Field(description="the children, running")
    paused_ms: float = Field(description="how long the parent was paused (0 from a checkpoint)")
    took_ms: float = Field(description="the worker's time for the whole fork")


def _not_found(what: str) -> APIError:
    return APIError(404, f"no {what}")


@router.post("/{sandbox_id}/checkpoints", status_code=201, response_model=Checkpoint)
async def create_checkpoint(
    sandbox_id: str, svc: Svc, caller: Caller, body: CheckpointCreate | None = None
) -> Checkpoint:
    """Memory and disk of a running sandbox, taken while it runs on (a short pause); its
    volumes are left out. 429 past the tenant's `checkpoints` or `checkpoint_mib` quota."""
    name = body.name if body is not None else ""
    row, url, epoch = await svc.store.begin_checkpoint(
        caller.id, sandbox_id, name, svc.settings.quotas
    )
    worker = Worker(row["worker_id"], url)
    try:
        taken = await svc.workers.checkpoint_vm(worker, sandbox_id, row["id"], epoch)
    except WorkerError:
        await svc.store.drop_checkpoint(row["id"])
        raise
    done = await svc.store.finish_checkpoint(row["id"], taken.size_bytes, taken.paused_ms)
    if done is None:
        raise APIError(409, f"sandbox {sandbox_id} was deleted while its checkpoint was taken")
    log.info("checkpoint %s of %s: paused %.0f ms", row["id"], sandbox_id, taken.paused_ms)
    return Checkpoint.from_row(done)


@router.get("/{sandbox_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(sandbox_id: str, svc: Svc, caller: Caller) -> CheckpointList:
    rows = await svc.store.checkpoints_of(caller.id, sandbox_id)
    return CheckpointList(items=[Checkpoint.from_row(r) for r in rows])


async def _checkpoint(
    svc: Svc, caller: Caller, sandbox_id: str, checkpoint_id: str
) -> tuple[Row, Worker, int]:
    try:
        row, url, epoch = await svc.store.checkpoint(caller.id, sandbox_id, checkpoint_id)
    except NotFound:
        raise _not_found(f"checkpoint {checkpoint_id} of sandbox {sandbox_id}") from None
    return row, Worker(row["worker_id"], url), epoch


@router.get("/{sandbox_id}/checkpoints/{checkpoint_id}", response_model=Checkpoint)
async def get_checkpoint(
    sandbox_id: str, checkpoint_id: str, svc: Svc, caller: Caller
) -> Checkpoint:
    return Checkpoint.from_row((await _checkpoint(svc, caller, sandbox_id, checkpoint_id))[0])


@router.delete("/{sandbox_id}/checkpoints/{checkpoint_id}", status_code=204)
async def delete_checkpoint(
    sandbox_id: str, checkpoint_id: str, svc: Svc, caller: Caller
) -> Response:
    """Its files go from the worker, then its record (it counts against the quota until)."""
    row, worker, epoch = await _checkpoint(svc, caller, sandbox_id, checkpoint_id)
    await svc.store.mark_deleting(row["id"])
    await svc.workers.delete_checkpoint(worker, sandbox_id, row["id"], epoch)
    await svc.store.drop_checkpoint(row["id"])
    return Response(status_code=204)


@router.post("/{sandbox_id}/checkpoints/{checkpoint_id}/rollback", response_model=Sandbox)
async def rollback(sandbox_id: str, checkpoint_id: str, svc: Svc, caller: Caller) -> Sandbox:
    """The running sandbox as it was at the checkpoint, in place: its processes and files as
    they were then; its id, network and egress policy stay (it gets a fresh agent token, our
    clock and a reseeded RNG). A sandbox with volumes cannot be rolled back (400)."""
    sb = await svc.store.get_sandbox(sandbox_id, caller.id)
    row, worker, epoch = await _checkpoint(svc, caller, sandbox_id, checkpoint_id)
    if row["state"] != "ready":
        raise APIError(409, f"checkpoint {checkpoint_id} is {row['state']}", state=row["state"])
    if sb["state"] != "running" or sb["desired_state"] != "running":
        raise APIError(409, f"sandbox {sandbox_id} is {sb['state']}, not running",
                       state=sb["state"])  # fmt: skip
    await svc.workers.rollback_vm(worker, sandbox_id, checkpoint_id, epoch)
    await svc.store.sandbox_event(sb, "rollback", f"to checkpoint {checkpoint_id}")
    return Sandbox.from_row(await svc.store.get_sandbox(sandbox_id, caller.id))


@router.post("/{sandbox_id}/fork", status_code=201, response_model=Forked)
async def fork(sandbox_id: str, body: ForkCreate, svc: Svc, caller: Caller) -> Forked:
    """`count` running children of the sandbox's state now (it runs on, paused briefly) or of
    one of its checkpoints. Each child is a sandbox of its own: id, hostname, agent token,
    clock, RNG state, network and egress state (the parent's policy and secret bindings), with
    `env` over the parent's. A sandbox with volumes cannot be forked (400)."""
    parent, url, epoch = await svc.store.fork_source(
        caller.id, sandbox_id, body.count, svc.settings.quotas
    )
    if body.checkpoint is not None:
        ck, _, _ = await _checkpoint(svc, caller, sandbox_id, body.checkpoint)
        if ck["state"] != "ready":
            raise APIError(409, f"checkpoint {body.checkpoint} is {ck['state']}", state=ck["state"])
    policy = await policy_for(svc.store, svc.sealer, parent, svc.settings.egress_default)
    env = {**parent["env"], **body.env}
    guest_env = {**env, **placeholder_env(parent["secrets"])}
    ids = [f"sb-{secrets.token_hex(8)}" for _ in range(body.count)]
    request = ForkVM(
        children=[ForkChild(id=i, hostname=i, env=guest_env, network=policy) for i in ids],
        checkpoint=body.checkpoint,
    )
    worker = Worker(parent["worker_id"], url)
    forked = await svc.workers.fork_vm(worker, sandbox_id, request, epoch)
    children = [{"id": i, "env": env, "metadata": body.metadata,
                 "request_id": logs.request_id.get(), "trace_parent": tracing.traceparent()}
                for i in ids]  # fmt: skip
    try:
        rows = await svc.store.insert_forks(parent, children, svc.settings.quotas)
    except Refused:  # past a quota after all (a concurrent create took the last of it)
        await _discard(svc, worker, ids, epoch)
        raise
    await svc.store.sandbox_event(parent, "fork", f"{body.count} children: {', '.join(ids)}")
    return Forked(items=[Sandbox.from_row(r) for r in rows], paused_ms=forked.paused_ms,
                  took_ms=forked.took_ms)  # fmt: skip


async def _discard(svc: Svc, worker: Worker, ids: list[str], epoch: int) -> None:
    """Children nobody will get; the worker's reconcile removes any this misses."""
    for vm_id in ids:
        try:
            await svc.workers.delete_vm(worker, vm_id, epoch)
        except WorkerError as e:
            log.warning("child %s of a refused fork not deleted: %s", vm_id, e.detail)

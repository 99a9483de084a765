"""E2B's fork: `count` new sandboxes of a running one's state now, by SPACE's fork (the parent
is paused briefly and runs on). Each child is answered as a create is, with its own access
tokens, so the SDK drives it as any sandbox."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field

from space.api import checkpoints
from space.api.checkpoints import ForkCreate
from space.api.deps import Svc
from space.e2b.rest import DEFAULT_TIMEOUT_S, E2BCaller, Lenient, alive, sandbox
from space.worker.api.models import MAX_FORK

router = APIRouter(tags=["e2b"])


class Fork(Lenient):
    timeout: int | None = Field(None, ge=1, le=7 * 24 * 3600)
    count: int = Field(1, ge=1, le=MAX_FORK)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, body: Fork, svc: Svc, who: E2BCaller) -> list[dict[str, Any]]:
    """The children, all running: SPACE's fork starts them together or none (a failed fork is
    the whole call's error, where E2B may answer some children with an error each). Each
    child's timeout is `timeout` from now, E2B's default when it is not sent."""
    await alive(svc, who, sandbox_id)
    forked = await checkpoints.fork(
        sandbox_id, ForkCreate(count=body.count, checkpoint=None), svc, who
    )
    children = []
    for child in forked.items:
        row = await svc.store.set_timeout(who.id, child.id, body.timeout or DEFAULT_TIMEOUT_S)
        children.append({"sandbox": sandbox(row, svc, who)})
    return children

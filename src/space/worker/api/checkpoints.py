"""Worker routes for checkpoints, rollbacks and forks (docs/worker-api.md). All are lifecycle
calls: fenced by the leader's epoch like the others."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from space.worker.api.bodies import read_body
from space.worker.api.models import CheckpointTaken, Forked, ForkVM, VMCreated
from space.worker.sandboxes.forks import Child

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI


class CheckpointRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api
        self.manager = api.manager

    async def take(self, request: Request) -> Response:
        self.api._fenced(request)
        started = time.perf_counter()
        vm_id, checkpoint_id = _ids(request)
        taken = await self.manager.checkpoint(vm_id, checkpoint_id)
        answer = CheckpointTaken(
            id=checkpoint_id, vm_id=vm_id, size_bytes=taken.size_bytes,
            paused_ms=round(taken.paused_ms, 3),
            took_ms=round((time.perf_counter() - started) * 1000, 3),
        )  # fmt: skip
        return JSONResponse(answer.model_dump(mode="json"))

    async def delete(self, request: Request) -> Response:
        self.api._fenced(request)
        await self.manager.delete_checkpoint(*_ids(request))
        return Response(status_code=204)

    async def rollback(self, request: Request) -> Response:
        self.api._fenced(request)
        sb = await self.manager.rollback(*_ids(request))
        return JSONResponse({"id": sb.id, "state": sb.state})

    async def fork(self, request: Request) -> Response:
        self.api._fenced(request)
        started = time.perf_counter()
        body = await read_body(ForkVM, request)
        children = [Child(c.id, c.hostname or f"sb-{c.id}", c.env, c.network)
                    for c in body.children]  # fmt: skip
        made, paused_ms = await self.manager.fork(
            str(request.path_params["vm_id"]), children, body.checkpoint
        )
        answer = Forked(
            children=[VMCreated(id=sb.id, state=sb.state, boot="fork",  # type: ignore[arg-type]
                                took_ms=round(sb.took_ms, 3)) for sb in made],
            paused_ms=round(paused_ms, 3),
            took_ms=round((time.perf_counter() - started) * 1000, 3),
        )  # fmt: skip
        return JSONResponse(answer.model_dump(mode="json"))


def _ids(request: Request) -> tuple[str, str]:
    return str(request.path_params["vm_id"]), str(request.path_params["checkpoint_id"])


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = CheckpointRoutes(api)
    one = "/vms/{vm_id}/checkpoints/{checkpoint_id}"
    return [
        Route(one, r.take, methods=["POST"]),
        Route(one, r.delete, methods=["DELETE"]),
        Route(f"{one}/rollback", r.rollback, methods=["POST"]),
        Route("/vms/{vm_id}/fork", r.fork, methods=["POST"]),
    ]

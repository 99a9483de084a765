"""Worker routes for template builds (docs/worker-api.md): started by the leader (fenced by
its epoch), followed by anyone the API lets."""

from __future__ import annotations

import base64
import binascii
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from space.worker.api.bodies import Problem, read_body
from space.worker.api.models import BuildRequest
from space.worker.builds import Build, BuildRefused, Builds

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI


class TemplateRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api
        self.builds = Builds(api.manager)

    async def start_build(self, request: Request) -> Response:
        self.api._fenced(request)
        body = await read_body(BuildRequest, request)
        name = str(request.path_params["name"])
        try:
            context = base64.b64decode(body.context, validate=True)
        except binascii.Error:
            raise Problem(400, "context must be base64 (of a tar archive)") from None
        try:
            if body.checkpoint is not None:
                source = body.checkpoint
                build = self.builds.from_checkpoint(
                    name, source.vm_id, source.checkpoint_id, body.request_id
                )
            else:
                build = await self.builds.start(
                    name, body.spec, context, body.environ, body.request_id
                )
        except BuildRefused as e:
            raise Problem(400, str(e)) from None
        return JSONResponse(build.status(), status_code=202)

    def _build(self, request: Request) -> Build:
        build = self.builds.get(str(request.path_params["build_id"]))
        if build is None:
            raise Problem(404, f"no build {request.path_params['build_id']} on this worker")
        return build

    async def build_status(self, request: Request) -> Response:
        return JSONResponse(self._build(request).status())

    async def build_log(self, request: Request) -> Response:
        """The build's log, one line per line, following it until the build ends."""
        build = self._build(request)

        async def lines() -> AsyncIterator[bytes]:
            async for line in build.log.follow():
                yield (line + "\n").encode()

        return StreamingResponse(lines(), media_type="text/plain; charset=utf-8")

    async def delete_template(self, request: Request) -> Response:
        self.api._fenced(request)
        await self.api.manager.remove_template(str(request.path_params["name"]))
        return Response(status_code=204)


def routes(api: WorkerAPI) -> list[BaseRoute]:
    r = TemplateRoutes(api)
    return [
        Route("/templates/{name}/builds", r.start_build, methods=["POST"]),
        Route("/templates/{name}", r.delete_template, methods=["DELETE"]),
        Route("/builds/{build_id}", r.build_status, methods=["GET"]),
        Route("/builds/{build_id}/log", r.build_log, methods=["GET"]),
    ]

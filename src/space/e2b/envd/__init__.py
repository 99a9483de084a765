"""E2B's in-sandbox daemon (envd), answered by the API for every sandbox: SPACE's guests take
no inbound connection, so the calls an E2B SDK makes to its sandbox's daemon come here (named
by `E2b-Sandbox-Id`) and go on to the sandbox's worker like SPACE's own data-plane calls.

The wire is Connect RPC (JSON, no compression) for the `process.Process` and
`filesystem.Filesystem` services (`space.e2b.proto`, generated from the .proto files there),
and plain HTTP for `/files` and `/health` (`files`)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from space.api.deps import Services
from space.e2b.envd.filesystem import FilesystemService
from space.e2b.envd.process import ProcessService
from space.e2b.proto.filesystem.filesystem_connect import FilesystemASGIApplication
from space.e2b.proto.process.process_connect import ProcessASGIApplication


class Envd:
    """ASGI: each Connect service of envd at its path (`/process.Process/Start`, …)."""

    def __init__(self, services: Callable[[], Services]) -> None:
        self.filesystem = FilesystemService(services)
        self.apps: dict[str, ASGIApp] = {
            "/process.Process/": ProcessASGIApplication(ProcessService(services), compressions=()),
            "/filesystem.Filesystem/": FilesystemASGIApplication(self.filesystem, compressions=()),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        for prefix, app in self.apps.items():
            if scope["type"] == "http" and path.startswith(prefix):
                await app(scope, receive, send)
                return
        await JSONResponse({"code": 404, "message": f"no envd route {path}"}, 404)(
            scope, receive, send
        )

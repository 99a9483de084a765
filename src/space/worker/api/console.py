"""A VM's serial console: the guest kernel's and its agent's messages, and whatever the guest
writes to /dev/console, read from its file on the host: its last bytes, then (following) what
comes, as it comes, until the VM stops or the reader leaves."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import IO, TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from space.worker.api.bodies import Problem
from space.worker.api.files import flag

if TYPE_CHECKING:
    from space.worker.api.server import WorkerAPI

TAIL_MAX = 1 << 20  # the most of its past a reader is given
CHUNK = 64 << 10
POLL_S = 0.5  # how often a follower looks for more


class ConsoleRoutes:
    def __init__(self, api: WorkerAPI) -> None:
        self.api = api

    async def read(self, request: Request) -> Response:
        vm_id = str(request.path_params["vm_id"])
        sb = self.api.manager.get(vm_id)
        machine = sb.live_machine("read the console of")
        try:
            tail = int(request.query_params.get("tail", "65536"))
        except ValueError:
            raise Problem(400, "tail must be a number of bytes") from None
        if not 0 <= tail <= TAIL_MAX:
            raise Problem(400, f"tail must be between 0 and {TAIL_MAX} bytes")
        follow = flag(request, "follow", False)
        path = machine.vm.console_log

        def still_there() -> bool:
            return self.api.manager.has(vm_id) and self.api.manager.get(vm_id).machine is machine

        async def body() -> AsyncIterator[bytes]:
            f: IO[bytes] | None = None
            with contextlib.suppress(FileNotFoundError):
                f = open(path, "rb")  # noqa: SIM115 - held across the stream's reads
            if f is None:
                return
            with f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - tail))
                while True:
                    chunk = await asyncio.to_thread(f.read, CHUNK)
                    if chunk:
                        yield chunk
                    elif not follow or not still_there():
                        return
                    else:
                        await asyncio.sleep(POLL_S)

        return StreamingResponse(body(), media_type="text/plain; charset=utf-8")


def routes(api: WorkerAPI) -> list[BaseRoute]:
    return [Route("/vms/{vm_id}/console", ConsoleRoutes(api).read, methods=["GET"])]

"""uvicorn's server, stopping so that a rollout resets no request.

uvicorn stops by closing its listeners and, at once, every connection with no request under
way. A connection accepted just before the stop may not have delivered its request yet: closed
unread, its client's request is reset. This server waits DRAIN_S between the two, so such a
request is read and answered (the stop then waits for it, as for any request under way)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

DRAIN_S = 1.0
# Idle connections are kept longer than clients keep theirs (httpx: 5 s, uvicorn's own default
# too): with equal times a client now and then sends a request on a connection the server is
# closing just then, and it fails unanswered (the API saw its worker "unreachable" under load).
KEEP_ALIVE_S = 10


class Server(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections; the base class closes them again, harmlessly
        await asyncio.sleep(DRAIN_S)
        await super().shutdown(sockets)

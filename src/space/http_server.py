"""uvicorn's server, stopping so that a rollout resets no request.

uvicorn stops by closing its listeners and, at once, every connection with no request under
way. Two kinds of connection are then reset with their request unanswered:
- those the kernel had completed but the server not accepted yet: closing a listener resets
  its queue, though each client's connect succeeded (so it cannot tell whether its request
  was read). They are accepted before the listeners close;
- those accepted whose request has not arrived yet. The server waits DRAIN_S before it
  closes idle connections, so such a request is read and answered (the stop then waits for
  it, as for any request under way)."""

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
        queued = [conn for server in self.servers for conn in _accept_queued(server)]
        for server in self.servers:
            server.close()  # no new connections; the base class closes them again, harmlessly
        if queued:
            await asyncio.wait([asyncio.ensure_future(self._take(c)) for c in queued],
                               timeout=DRAIN_S)  # fmt: skip
        await asyncio.sleep(DRAIN_S)
        await super().shutdown(sockets)

    async def _take(self, conn: socket.socket) -> None:
        """Serves a connection accepted here rather than by the listener, as uvicorn would."""
        config = self.config
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=self.server_state, app_state=self.lifespan.state
                ),
                conn,
                ssl=config.ssl,
            )
        except OSError:
            conn.close()  # its client went away, or its TLS handshake failed or timed out


def _accept_queued(server: asyncio.base_events.Server) -> list[socket.socket]:
    """The connections waiting in the listeners' queues, accepted without waiting."""
    queued = []
    for listener in server.sockets:
        # A duplicate of the listener: the same queue, without the event loop's wrapper.
        with socket.socket(fileno=socket.dup(listener.fileno())) as sock:
            sock.setblocking(False)
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:  # the queue is empty (or out of descriptors: close as before)
                    break
                conn.setblocking(False)
                queued.append(conn)
    return queued

"""uvicorn's server, stopping so that a rollout resets no request.

uvicorn stops by closing its listeners and, at once, every connection with no request under
way. Three kinds of connection are then reset with their request unanswered:
- those the kernel had completed but the server not accepted yet: closing a listener resets
  its queue, though each client's connect succeeded (so it cannot tell whether its request
  was read). They are accepted before the listeners close (at most a backlog's worth each);
- those accepted whose request has not arrived yet. The server waits DRAIN_S before it
  closes idle connections, so such a request is read and answered (the stop then waits for
  it, as for any request under way);
- those kept alive by their client after an answer that ended once the stop had begun: uvicorn
  closes them after it without saying so, and the client's next request goes out on a
  connection being closed. Every answer begun after the stop began says `Connection: close`,
  so the client opens a new connection (refused, until a replacement listens) instead; an
  answer already under way (a stream) cannot say it any more."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DRAIN_S = 1.0
# Idle connections are kept longer than clients keep theirs (httpx: 5 s, uvicorn's own default
# too): with equal times a client now and then sends a request on a connection the server is
# closing just then, and it fails unanswered (the API saw its worker "unreachable" under load).
KEEP_ALIVE_S = 10
# accept(2)'s errors of the server's own: nothing more can be accepted now.
OUT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EBADF, errno.EINVAL}


CLOSE = (b"connection", b"close")


class Server(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # Every connection's protocol, made from here on, takes the application from here.
        config = self.config
        config.loaded_app = _closing_once_stopped(config.loaded_app, lambda: self.should_exit)
        await super().startup(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        queued = [c for server in self.servers for c in _accept_queued(server, self.config.backlog)]
        for server in self.servers:
            server.close()  # no new connections; the base class closes them again, harmlessly
        if queued:
            # A plain connection is taken at once, a TLS one once its handshake ended (within
            # DRAIN_S): each is then among uvicorn's connections when its shutdown looks.
            await asyncio.wait([asyncio.ensure_future(self._take(c)) for c in queued])
        await asyncio.sleep(DRAIN_S)
        await super().shutdown(sockets)

    async def _take(self, conn: socket.socket) -> None:
        """Serves a connection accepted here rather than by the listener, as uvicorn would."""
        config = self.config
        # Failing (its client went away, its TLS handshake failed or took too long), the
        # transport made of it has closed it.
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: config.http_protocol_class(  # type: ignore[call-arg]
                    config=config, server_state=self.server_state, app_state=self.lifespan.state
                ),
                conn,
                ssl=config.ssl,
                ssl_handshake_timeout=DRAIN_S if config.ssl else None,
            )


def _closing_once_stopped(app: ASGIApp, stopped: Callable[[], bool]) -> ASGIApp:
    """`app`, whose HTTP answers begun once `stopped()` say `Connection: close`."""

    async def closing(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and stopped():
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"connection" for name, _ in headers):
                    message = {**message, "headers": [*headers, CLOSE]}
            await send(message)

        await app(scope, receive, send_closing)

    return closing


def _accept_queued(server: asyncio.base_events.Server, most: int) -> list[socket.socket]:
    """Up to `most` connections waiting in each of the listeners' queues, accepted without
    waiting. Nothing when a descriptor cannot be had: the stop goes on as uvicorn's would."""
    queued = []
    for listener in server.sockets:
        try:
            # A duplicate of the listener: the same queue, without the event loop's wrapper.
            sock = socket.socket(fileno=socket.dup(listener.fileno()))
        except OSError:
            continue
        with sock:
            sock.setblocking(False)
            for _ in range(most):
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break  # the queue is empty
                except OSError as e:
                    if e.errno in OUT_OF:
                        break  # the stop goes on as uvicorn's would
                    continue  # that connection's own error (accept(2)): the next one is fine
                conn.setblocking(False)
                queued.append(conn)
    return queued

"""`space forward`: a port of a sandbox on a local address, for a browser or curl; `space link`:
one at its preview host for anyone holding the link (`api/previews.py`).

Sandboxes accept no inbound connection; the API's ingress route is the one way in and wants
the API key. This command listens on a local address (loopback unless told otherwise) and
sends each HTTP request it takes there through ingress with the key, streaming both ways, so
local tools need no key and no knowledge of the API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import click

from space.cli import interrupt
from space.cli.completion import complete_sandbox_ids
from space.cli.sandbox import _api_options, _sdk_errors

if TYPE_CHECKING:
    from space.client import AsyncSpace

# Framing and credentials are the hops' own: httpx and the local server frame what they send,
# and the API key must not be replaced by whatever the local client sends.
HOP_IN = {"host", "authorization", "connection", "keep-alive", "transfer-encoding",
          "content-length", "upgrade", "proxy-authorization", "te", "trailer"}  # fmt: skip
HOP_OUT = {"connection", "keep-alive", "transfer-encoding", "via"}
Scope = dict[str, Any]


def forwarder(space: AsyncSpace, sandbox_id: str, port: int) -> Any:
    """The ASGI app that relays each request to `port` of the sandbox."""
    import httpx

    from space.client import SpaceError
    from space.client._calls import port_path

    # A stream lasts as long as the service sends; the API bounds the wait for its head.
    timeout = httpx.Timeout(30.0, read=None)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return  # WebSocket: ingress relays plain HTTP only

        async def body() -> AsyncIterator[bytes]:
            more = True
            while more:
                message = await receive()
                more = message.get("more_body", False)
                if chunk := message.get("body", b""):
                    yield chunk

        headers = [(k, v) for k, v in scope["headers"] if k.decode().lower() not in HOP_IN]
        framed = {k.lower() for k, _ in scope["headers"]} & {
            b"content-length",
            b"transfer-encoding",
        }
        request = space._http.build_request(
            scope["method"],
            port_path(sandbox_id, port, scope["path"]),
            params=scope["query_string"].decode(),
            headers=headers,
            content=body() if framed else None,
            timeout=timeout,
        )
        try:
            answer = await space._http.send(request, stream=True)
        except (SpaceError, httpx.HTTPError) as e:
            why = str(e).encode()
            await send({"type": "http.response.start", "status": 502,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8")]})  # fmt: skip
            await send({"type": "http.response.body", "body": why + b"\n"})
            return
        try:
            out = [(k, v) for k, v in answer.headers.raw if k.decode().lower() not in HOP_OUT]
            await send({"type": "http.response.start", "status": answer.status_code,
                        "headers": out})  # fmt: skip
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await answer.aclose()

    return app


@click.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--local-port", "-l", type=click.IntRange(0, 65535), default=None,
              help="Local port to listen on  [default: PORT; 0 picks a free one]")  # fmt: skip
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Local address to listen on (anyone who reaches it uses your key).")  # fmt: skip
@_api_options
def forward(
    api_url: str | None,
    api_key: str | None,
    sandbox_id: str,
    port: int,
    local_port: int | None,
    bind: str,
) -> None:
    """Serve PORT of a sandbox on a local address. Each HTTP request there goes through the
    API's ingress with your key, until Ctrl-C."""
    import asyncio
    import contextlib
    import socket

    import uvicorn

    from space.client import AsyncSpace, Sandbox, Space

    with _sdk_errors(), Space(api_url, api_key) as sync:
        Sandbox.get(sandbox_id, client=sync)  # a clear error now, not on the first request

    # Bound here, before serving: a port in use is a clear error, and port 0 tells its number.
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((bind, port if local_port is None else local_port))
        # Listening before it says so: a client that connects at once waits in the backlog
        # instead of being refused while the server starts.
        listener.listen(128)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {bind}: {e.strerror}") from None
    host, bound = listener.getsockname()[:2]

    async def serve() -> None:
        async with AsyncSpace(api_url, api_key) as space:
            app = forwarder(space, sandbox_id, port)
            # Its own Ctrl-C handling waits for the requests it serves: a bounded wait, as every
            # command's (space.cli.interrupt), even for one stuck on an API that never answers.
            config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=interrupt.GRACE_S)  # fmt: skip
            server = uvicorn.Server(config)
            click.echo(f"forwarding http://{host}:{bound}/ to port {port} of {sandbox_id} "
                       "(Ctrl-C to stop)", err=True)  # fmt: skip
            await server.serve(sockets=[listener])

    # uvicorn stops on Ctrl-C, then raises it again: a stop asked for, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


@click.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("port", type=click.IntRange(1, 65535))
@click.option("--expires", "expires_in_s", type=click.IntRange(1, 7 * 24 * 3600), default=3600,
              show_default=True, help="Seconds the link works for (at most a week).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the link as JSON.")
@_api_options
def link(
    api_url: str | None,
    api_key: str | None,
    sandbox_id: str,
    port: int,
    expires_in_s: int,
    as_json: bool,
) -> None:
    """Print a link that opens PORT of a sandbox in a browser, without a key. Whoever holds it
    can use it until it expires or your key is revoked."""
    import json

    from space.client import Sandbox, Space

    with _sdk_errors(), Space(api_url, api_key) as space:
        made = Sandbox.get(sandbox_id, client=space).link(port, expires_in_s)
    if as_json:
        when = made.expires_at.isoformat()
        click.echo(json.dumps({"url": made.url, "port": made.port, "expires_at": when}))
    else:
        click.echo(made.url)
        click.echo(f"works until {made.expires_at:%Y-%m-%d %H:%M:%S %Z}", err=True)

"""`space mcp`: SPACE's sandboxes as an MCP server, over stdio or streamable HTTP.

Over stdio the server is the user's own process and acts with the key the CLI would use. Over
HTTP it holds no key at all: each request must carry a SPACE API key (`Authorization: Bearer`),
checked by the API on every call a tool makes, so one server can serve many tenants and a
caller without a key gets 401 before any tool runs.
"""

from __future__ import annotations

import anyio
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from starlette.types import ASGIApp, Receive, Scope, Send

from space import __version__
from space.mcp.tools import Keys, SandboxTools

INSTRUCTIONS = (
    "SPACE runs each sandbox as a Linux microVM of its own. Create one with create_sandbox, "
    "work in it with run_command, run_code and the file tools, and delete it when done. Its "
    "egress is denied unless set_egress (or allow_hosts at create) names the hosts it may reach."
)


def build(keys: Keys) -> MCPServer:
    server: MCPServer = MCPServer(
        "space", instructions=INSTRUCTIONS, version=__version__, log_level="WARNING"
    )
    SandboxTools(keys).register(server)
    return server


def serve_stdio(api_url: str, api_key: str) -> None:
    anyio.run(build(lambda _ctx: (api_url, api_key)).run_stdio_async)


def _bearer(headers: dict[str, str] | None) -> str | None:
    value = (headers or {}).get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def http_app(api_url: str, host: str) -> ASGIApp:
    def keys(ctx: Context) -> tuple[str, str]:
        key = _bearer(dict(ctx.headers or {}))
        if key is None:  # (the middleware lets no such request through)
            raise ToolError("no SPACE API key: send Authorization: Bearer <key>")
        return api_url, key

    # Stateless: no session outlives its request, so callers (even with made-up keys, which
    # the API refuses on their first call) cannot fill the server with sessions.
    return _KeyRequired(build(keys).streamable_http_app(host=host, stateless_http=True))


class _KeyRequired:
    """401 for a request without a bearer key: nothing of the server is reached without one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope["headers"]}  # fmt: skip
            if _bearer(headers) is None:
                body = b'{"error": "send your SPACE API key: Authorization: Bearer <key>"}'
                await send({
                    "type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b'Bearer realm="space"')],
                })  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def serve_http(api_url: str, host: str, port: int) -> None:
    config = uvicorn.Config(http_app(api_url, host), host=host, port=port, log_level="warning")
    uvicorn.Server(config).run()

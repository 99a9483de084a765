"""`space mcp`: an MCP server for SPACE's sandboxes (stdio by default, or streamable HTTP)."""

from __future__ import annotations

import click

from space.cli.sandbox import _api_options, _sdk_errors


@click.command("mcp")
@_api_options
@click.option(
    "--http",
    "listen",
    metavar="HOST:PORT",
    help="Serve streamable HTTP at http://HOST:PORT/mcp instead of stdio; each request then "
    "carries its own SPACE API key (Authorization: Bearer) and the server holds none.",
)
def mcp(api_url: str | None, api_key: str | None, listen: str | None) -> None:
    """Serve SPACE's sandboxes to MCP clients (stdio, or streamable HTTP with --http).

    Tools to create a sandbox, run commands and code, read, write and list files, set its
    egress, expose a port, and delete it."""
    from space.client._config import resolve_api_url, resolve_credentials
    from space.mcp import server

    if listen is None:
        with _sdk_errors():
            found = resolve_credentials(api_url, api_key)
        server.serve_stdio(found.api_url, found.api_key)
        return
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--http")
    source = click.get_current_context().get_parameter_source("api_key")
    if api_key and source == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError("over HTTP each request brings its own key: drop --api-key")
    server.serve_http(resolve_api_url(api_url), host.strip("[]"), int(port))

"""What an MCP client can do with SPACE: the tools, each a call or two of the SDK.

Every tool acts with one tenant's API key, which `keys` gives for the request (the server's own
over stdio, the caller's over HTTP), so an MCP client can reach only what that key can. Failures
the caller can act on (no such sandbox, a sandbox that is not running, a quota, a bad policy)
come back as tool errors carrying the API's own words; output is capped so that one command
cannot fill a model's context.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from space.client import AsyncSandbox, AsyncSpace, SandboxInfo, SpaceError

OUTPUT_CAP = 256 * 1024  # bytes of stdout (and of stderr) a tool answers with
FILE_CAP = 1 << 20  # bytes read_file answers with

# Who the request acts as: the API's URL and a key, from the request's context.
Keys = Callable[[Context], tuple[str, str]]

SandboxId = Annotated[str, Field(description="the sandbox's id (sb-…), from create_sandbox")]
Path_ = Annotated[str, Field(description="an absolute path inside the sandbox")]


def _sandbox(info: SandboxInfo) -> dict[str, Any]:
    return {
        "id": info.id, "state": info.state, "template": info.template,
        "vcpus": info.vcpus, "memory_mib": info.memory_mib,
        "expires_at": info.expires_at.isoformat() if info.expires_at else None,
        "metadata": dict(info.metadata),
    }  # fmt: skip


class _Capped:
    """A stream's first OUTPUT_CAP bytes, and how many more came (counted, not kept: one
    command's output must not fill a server that many tenants share)."""

    def __init__(self) -> None:
        self.kept = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = OUTPUT_CAP - len(self.kept)
        self.kept += data[:room]
        self.dropped += max(0, len(data) - room)

    def text(self) -> str:
        cut = self.kept.decode(errors="replace")
        return f"{cut}\n[… {self.dropped} more bytes]" if self.dropped else cut


async def _run(sb: AsyncSandbox, command: str | list[str], **options: Any) -> dict[str, Any]:
    """Run to its end; exit status and capped output."""
    out = {"stdout": _Capped(), "stderr": _Capped()}
    async with sb.exec_stream(command, **options) as stream:
        async for name, data in stream:
            out[name].add(data)
    result = stream.result
    assert result is not None
    return {
        "exit_code": result.exit_code, "signal": result.signal, "timed_out": result.timed_out,
        "stdout": out["stdout"].text(), "stderr": out["stderr"].text(),
        "duration_ms": round(result.duration_ms),
    }  # fmt: skip


class SandboxTools:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    @asynccontextmanager
    async def _client(self, ctx: Context) -> AsyncIterator[AsyncSpace]:
        url, key = self.keys(ctx)
        client = AsyncSpace(url, key, timeout=330)
        try:
            yield client
        except SpaceError as e:  # the API's own words, for the model to act on
            raise ToolError(str(e)) from None
        finally:
            await client.aclose()

    @asynccontextmanager
    async def _one(self, ctx: Context, sandbox_id: str) -> AsyncIterator[AsyncSandbox]:
        async with self._client(ctx) as client:
            yield await AsyncSandbox.get(sandbox_id, client=client)

    def register(self, server: MCPServer) -> None:
        safe = ToolAnnotations(read_only_hint=True, open_world_hint=False)
        changes = ToolAnnotations(read_only_hint=False, destructive_hint=False)
        gone = ToolAnnotations(read_only_hint=False, destructive_hint=True)
        for tool, hints in (
            (self.create_sandbox, changes), (self.list_sandboxes, safe),
            (self.run_command, changes), (self.run_code, changes),
            (self.read_file, safe), (self.write_file, changes), (self.list_files, safe),
            (self.set_egress, changes), (self.expose_port, safe),
            (self.delete_sandbox, gone),
        ):  # fmt: skip
            server.tool(annotations=hints)(tool)

    async def create_sandbox(
        self,
        ctx: Context,
        template: Annotated[str, Field(description="the template to start from")] = "base",
        vcpus: Annotated[int, Field(ge=1, le=16)] = 1,
        memory_mib: Annotated[int, Field(ge=128, le=65536)] = 256,
        timeout_s: Annotated[
            int, Field(ge=1, le=86400, description="seconds until it is paused unless renewed")
        ] = 600,
        env: Annotated[
            dict[str, str] | None, Field(description="environment of its commands")
        ] = None,
        allow_hosts: Annotated[
            list[str] | None,
            Field(description="host names (or *.suffix patterns) it may reach; none: no egress"),
        ] = None,
        metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Start a new Linux sandbox (a microVM of its own) and answer once it runs. Its egress
        is denied except to `allow_hosts`."""
        network = {"default": "deny", "hosts": [{"pattern": h} for h in allow_hosts or []]}
        async with self._client(ctx) as client:
            sb = await AsyncSandbox.create(
                client=client, template=template, vcpus=vcpus, memory_mib=memory_mib,
                timeout_s=timeout_s, env=env, metadata=metadata, network=network,
            )  # fmt: skip
            return _sandbox(sb.info)

    async def list_sandboxes(
        self,
        ctx: Context,
        state: Annotated[str | None, Field(description="only those in this state")] = None,
    ) -> dict[str, Any]:
        """The sandboxes of this key's tenant, newest first (at most 100)."""
        found: list[dict[str, Any]] = []
        async with self._client(ctx) as client:
            async for sb in AsyncSandbox.list(client=client, state=state):
                if sb.state != "deleted":
                    found.append(_sandbox(sb.info))
                if len(found) == 100:
                    break
        return {"sandboxes": found}

    async def run_command(
        self,
        ctx: Context,
        sandbox_id: SandboxId,
        command: Annotated[str, Field(description="a shell command line (run by /bin/sh -c)")],
        cwd: str | None = None,
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60,
        stdin: Annotated[str | None, Field(description="text fed to its standard input")] = None,
    ) -> dict[str, Any]:
        """Run a command in the sandbox to its end: exit code, stdout and stderr (each cut at
        256 KiB)."""
        async with self._one(ctx, sandbox_id) as sb:
            return await _run(sb, command, cwd=cwd, timeout=timeout_s, stdin=stdin)

    async def run_code(
        self,
        ctx: Context,
        sandbox_id: SandboxId,
        code: Annotated[str, Field(description="the program's source")],
        language: Literal["python", "bash", "sh"] = "python",
        timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60,
    ) -> dict[str, Any]:
        """Run a program in the sandbox (Python 3 by default): exit code, stdout, stderr."""
        path = f"/tmp/space-mcp-{secrets.token_hex(6)}"
        interpreter = {"python": "python3", "bash": "bash", "sh": "sh"}[language]
        async with self._one(ctx, sandbox_id) as sb:
            await sb.files.write(path, code.encode())
            try:
                return await _run(sb, [interpreter, path], timeout=timeout_s)
            finally:
                with contextlib.suppress(SpaceError):  # (the program may have removed it)
                    await sb.files.remove(path)

    async def read_file(self, ctx: Context, sandbox_id: SandboxId, path: Path_) -> dict[str, Any]:
        """A file's content: UTF-8 text, or base64 when it is not text (1 MiB at most)."""
        async with self._one(ctx, sandbox_id) as sb:
            if (await sb.files.stat(path)).type == "directory":
                raise ToolError(f"{path} is a directory, not a file (list_files lists one)")
            data = bytearray()
            chunks = sb.files.iter(path)  # (links followed; read only as far as the cap)
            try:
                async for chunk in chunks:
                    data += chunk
                    if len(data) > FILE_CAP:
                        raise ToolError(
                            f"{path} holds more than the {FILE_CAP} bytes read_file answers "
                            "with: read a part with run_command (head, tail, sed -n)"
                        )
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
        try:
            return {"path": path, "encoding": "utf-8", "content": bytes(data).decode()}
        except UnicodeDecodeError:
            return {"path": path, "encoding": "base64", "content": base64.b64encode(data).decode()}

    async def write_file(
        self,
        ctx: Context,
        sandbox_id: SandboxId,
        path: Path_,
        content: str,
        encoding: Annotated[
            Literal["utf-8", "base64"], Field(description="how `content` is written")
        ] = "utf-8",
    ) -> dict[str, Any]:
        """Write a file whole (its directories are made); it appears whole or not at all."""
        try:
            data = base64.b64decode(content, validate=True) if encoding == "base64" else (
                content.encode())  # fmt: skip
        except binascii.Error as e:
            raise ToolError(f"content is not base64: {e}") from None
        async with self._one(ctx, sandbox_id) as sb:
            await sb.files.write(path, data, make_parents=True)
        return {"path": path, "size": len(data)}

    async def list_files(
        self, ctx: Context, sandbox_id: SandboxId, path: Path_ = "/"
    ) -> dict[str, Any]:
        """The entries of a directory: name, type, size, mode."""
        async with self._one(ctx, sandbox_id) as sb:
            entries = await sb.files.list(path)
        return {"path": path, "entries": [
            {"name": e.name, "type": e.type, "size": e.size, "mode": oct(e.mode)}
            for e in entries
        ]}  # fmt: skip

    async def set_egress(
        self,
        ctx: Context,
        sandbox_id: SandboxId,
        allow_hosts: Annotated[
            list[str], Field(description="host names (or *.suffix patterns) it may reach")
        ],
        default: Annotated[
            Literal["deny", "allow"],
            Field(description="for every other public name; private networks stay closed"),
        ] = "deny",
    ) -> dict[str, Any]:
        """Replace the sandbox's egress policy; in force at once for new connections."""
        network = {"default": default, "hosts": [{"pattern": h} for h in allow_hosts]}
        async with self._one(ctx, sandbox_id) as sb:
            info = await sb.set_network(network)
        return {"id": info.id, "network": network}

    async def expose_port(
        self,
        ctx: Context,
        sandbox_id: SandboxId,
        port: Annotated[int, Field(ge=1, le=65535, description="where a server listens in it")],
        link_for_s: Annotated[
            int,
            Field(
                ge=0,
                le=7 * 24 * 3600,
                description=(
                    "if not 0, also a link that opens the port in a browser without a key, for "
                    "this many seconds; anyone who holds it can use it"
                ),
            ),
        ] = 0,
    ) -> dict[str, Any]:
        """The URL at which a server listening on `port` inside the sandbox answers HTTP
        (sandboxes take no inbound connection: the API relays it), and a link for a browser
        when asked for."""
        async with self._client(ctx) as client:
            sb = await AsyncSandbox.get(sandbox_id, client=client)
            auth = "send the same SPACE API key: Authorization: Bearer <key>"
            answer = {"url": sb.port_url(port), "auth": auth}
            if link_for_s:
                link = await sb.link(port, link_for_s)
                answer |= {"link": link.url, "link_expires_at": link.expires_at.isoformat()}
        return answer

    async def delete_sandbox(self, ctx: Context, sandbox_id: SandboxId) -> dict[str, Any]:
        """Delete the sandbox: its VM, its disk and everything in it."""
        async with self._one(ctx, sandbox_id) as sb:
            return _sandbox(await sb.delete())

"""`space mcp` driven by the official `mcp` client SDK against the real stack: a whole task over
stdio, and over streamable HTTP where each request brings its tenant's key."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

import space

from ..stack import Platform, free_port
from .helpers import FETCH

pytestmark = pytest.mark.vm

EXPECTED_TOOLS = {
    "create_sandbox", "list_sandboxes", "run_command", "run_code", "read_file", "write_file",
    "list_files", "set_egress", "expose_port", "delete_sandbox",
}  # fmt: skip


def _stdio(platform: Platform, key: str) -> StdioServerParameters:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": key}
    return StdioServerParameters(command=sys.executable, args=["-m", "space.cli.main", "mcp"],
                                 env=env)  # fmt: skip


async def _call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    r = await client.call_tool(tool, arguments)
    assert not r.is_error, (tool, r.content)
    assert r.structured_content is not None, (tool, r.content)
    return r.structured_content


async def _refused(client: Client, tool: str, **arguments: Any) -> str:
    r = await client.call_tool(tool, arguments)
    assert r.is_error, (tool, r.structured_content)
    return " ".join(getattr(c, "text", "") for c in r.content)


async def test_an_mcp_client_does_a_whole_task_over_stdio(platform: Platform) -> None:
    async with Client(_stdio(platform, platform.key_a)) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == EXPECTED_TOOLS
        assert tools["delete_sandbox"].annotations is not None
        assert tools["delete_sandbox"].annotations.destructive_hint is True
        assert "sandbox_id" in tools["run_command"].input_schema["required"]

        sb = await _call(client, "create_sandbox", metadata={"by": "mcp"})
        sid = sb["id"]
        assert sb["state"] == "running"
        try:
            listed = await _call(client, "list_sandboxes")
            assert sid in {s["id"] for s in listed["sandboxes"]}

            script = "import json, sys\nprint(json.dumps({'sum': sum(range(10))}))\n"
            wrote = await _call(client, "write_file", sandbox_id=sid, path="/work/a/s.py",
                                content=script)  # fmt: skip
            assert wrote["size"] == len(script)
            ran = await _call(client, "run_command", sandbox_id=sid, command="python3 s.py",
                              cwd="/work/a")  # fmt: skip
            assert ran["exit_code"] == 0 and json.loads(ran["stdout"]) == {"sum": 45}, ran
            assert (await _call(client, "read_file", sandbox_id=sid, path="/work/a/s.py"))[
                "content"] == script  # fmt: skip
            names = {
                e["name"]
                for e in (await _call(client, "list_files", sandbox_id=sid, path="/work/a"))[
                    "entries"
                ]
            }
            assert names == {"s.py"}

            code = await _call(client, "run_code", sandbox_id=sid,
                               code="import sys\nprint(6*7)\nsys.exit(3)")  # fmt: skip
            assert code["stdout"] == "42\n" and code["exit_code"] == 3, code
            tidy = "import os, sys\nos.remove(sys.argv[0])\nprint('bye')"  # removes itself
            gone = await _call(client, "run_code", sandbox_id=sid, code=tidy)
            assert (gone["exit_code"], gone["stdout"]) == (0, "bye\n"), gone
            loud = await _call(client, "run_command", sandbox_id=sid,
                               command="head -c 600000 /dev/zero | tr '\\0' a")  # fmt: skip
            assert loud["stdout"].startswith("a" * 262144), loud["stdout"][:100]
            assert loud["stdout"].endswith(f"[… {600000 - 262144} more bytes]")
            linked = await _call(client, "read_file", sandbox_id=sid, path="/etc/os-release")
            assert "ID=" in linked["content"]  # a symlink, followed
            piped = await _call(client, "run_command", sandbox_id=sid, command="tr a-z A-Z",
                                stdin="shout")  # fmt: skip
            assert piped["stdout"] == "SHOUT"
            slow = await _call(client, "run_command", sandbox_id=sid, command="sleep 30",
                               timeout_s=1)  # fmt: skip
            assert slow["timed_out"] is True

            blob = bytes(range(256))
            await _call(client, "write_file", sandbox_id=sid, path="/work/b.bin",
                        content=base64.b64encode(blob).decode(), encoding="base64")  # fmt: skip
            back = await _call(client, "read_file", sandbox_id=sid, path="/work/b.bin")
            assert back["encoding"] == "base64" and base64.b64decode(back["content"]) == blob

            # Egress: denied until the agent opens a host, then only that host.
            fetch = ["python3", "-c", FETCH]
            fetch_cmd = " ".join(f"'{a}'" for a in fetch)
            denied = await _call(client, "run_command", sandbox_id=sid,
                                 command=f"{fetch_cmd} http://allowed.test/")  # fmt: skip
            assert denied["exit_code"] == 3, denied
            await _call(client, "set_egress", sandbox_id=sid, allow_hosts=["allowed.test"])
            opened = await _call(client, "run_command", sandbox_id=sid,
                                 command=f"{fetch_cmd} http://allowed.test/")  # fmt: skip
            assert opened["exit_code"] == 0 and "hello from allowed.test" in opened["stdout"]
            other = await _call(client, "run_command", sandbox_id=sid,
                                command=f"{fetch_cmd} http://other.test/")  # fmt: skip
            assert other["exit_code"] == 3
            # The SDK reads the gateway's trail of those decisions.
            async with space.AsyncSpace(platform.api_url, platform.key_a) as sdk:
                trail = await (await space.AsyncSandbox.get(sid, client=sdk)).audit()
            decided = {(e.host, e.decision) for e in trail}
            assert {("allowed.test", "allow"), ("other.test", "deny")} <= decided, trail
            assert [e.seq for e in trail] == sorted(e.seq for e in trail)

            # A port exposed: its URL answers with the same key, through the API.
            serve = "mkdir -p /srv && echo via-mcp > /srv/i.html && cd /srv && " \
                    "(nohup python3 -m http.server 8000 >/dev/null 2>&1 &)"  # fmt: skip
            await _call(client, "run_command", sandbox_id=sid, command=serve)
            url = (await _call(client, "expose_port", sandbox_id=sid, port=8000))["url"]
            assert url == f"{platform.api_url}/v1/sandboxes/{sid}/ports/8000/"
            assert _served(url + "i.html", platform.key_a) == "via-mcp\n"
            # And for a browser, a link to its preview host that needs no key.
            shared = await _call(client, "expose_port", sandbox_id=sid, port=8000,
                                 link_for_s=600)  # fmt: skip
            assert shared["url"] == url and shared["link_expires_at"]
            assert _linked(shared["link"], sid, platform.api_url) == "via-mcp\n"

            # What the model gets wrong comes back as a tool error it can read.
            assert "404" in await _refused(client, "run_command", sandbox_id="sb-nope",
                                           command="true")  # fmt: skip
            big = await _call(client, "run_command", sandbox_id=sid,
                              command="head -c 2000000 /dev/zero > /work/big")  # fmt: skip
            assert big["exit_code"] == 0
            assert "head, tail" in await _refused(client, "read_file", sandbox_id=sid,
                                                  path="/work/big")  # fmt: skip
            assert "directory" in await _refused(client, "read_file", sandbox_id=sid,
                                                 path="/work")  # fmt: skip
            assert await _refused(client, "create_sandbox", memory_mib=1)
            assert "base64" in await _refused(client, "write_file", sandbox_id=sid,
                                              path="/work/x", content="%%",
                                              encoding="base64")  # fmt: skip
            assert "422" in await _refused(client, "set_egress", sandbox_id=sid,
                                           allow_hosts=["bad host!"])  # fmt: skip
        finally:
            gone = await _call(client, "delete_sandbox", sandbox_id=sid)
        assert gone["state"] == "deleted"


def _served(url: str, key: str) -> str:
    deadline = time.monotonic() + 30
    while (r := httpx.get(url, headers={"Authorization": f"Bearer {key}"})).status_code == 502:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.3)
    assert r.status_code == 200, r.text
    return r.text


def _linked(url: str, sandbox_id: str, api_url: str) -> str:
    """The page a link opens: its token traded for the cookie, then the page with it."""
    link = httpx.URL(url)
    assert link.host == f"8000-{sandbox_id}.localhost", link
    host = {"Host": link.netloc.decode()}
    traded = httpx.get(f"{api_url}/i.html?{link.query.decode()}", headers=host)
    assert traded.status_code == 303, traded.text
    return httpx.get(f"{api_url}/i.html", headers=host, cookies=traded.cookies).text


@pytest.fixture(scope="module")
def mcp_http(platform: Platform) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "SPACE_API_URL": platform.api_url}
    env.pop("SPACE_API_KEY", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "space.cli.main", "mcp", "--http", f"127.0.0.1:{port}"], env=env
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "space mcp --http"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _as(url: str, key: str) -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return Client(streamable_http_client(url, http_client=http))


async def test_over_http_each_request_acts_as_the_key_it_brings(
    platform: Platform, mcp_http: str
) -> None:
    # No key, no server: refused before any MCP message is read.
    async with httpx.AsyncClient() as raw:
        r = await raw.post(mcp_http, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert r.status_code == 401 and "Bearer" in r.headers["www-authenticate"]
    async with _as(mcp_http, platform.key_a) as a, _as(mcp_http, platform.key_b) as b:
        sid = (await _call(a, "create_sandbox"))["id"]
        try:
            ran = await _call(a, "run_command", sandbox_id=sid, command="echo $((6*7))")
            assert ran["stdout"] == "42\n"
            # Tenant B's key reaches none of A's sandboxes through the same server.
            assert "404" in await _refused(b, "run_command", sandbox_id=sid, command="true")
            assert "404" in await _refused(b, "delete_sandbox", sandbox_id=sid)
            assert sid not in {s["id"] for s in (await _call(b, "list_sandboxes"))["sandboxes"]}
        finally:
            await _call(a, "delete_sandbox", sandbox_id=sid)
    async with _as(mcp_http, "sk_space_forged") as forged:
        assert "401" in await _refused(forged, "list_sandboxes")

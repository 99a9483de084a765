"""E2B's own Python SDK, unmodified (the pinned `e2b` from PyPI), against SPACE: its documented
uses, sync and async, in real sandboxes, through the E2B-compatible REST API and the envd
daemon the API answers for every sandbox. And what it must not do: another tenant's token, an
altered token, a revoked key."""

from __future__ import annotations

import asyncio
import gzip
import os
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxQuery,
    SandboxState,
)
from e2b.exceptions import AuthenticationException, SandboxException

from ..stack import Platform

pytestmark = pytest.mark.vm


def opts(platform: Platform, key: str | None = None) -> dict[str, Any]:
    """What an E2B user sets to use SPACE: the key, the API URL and the sandbox URL."""
    return {
        "api_key": key or platform.key_a,
        "api_url": f"{platform.api_url}/e2b",
        "sandbox_url": f"{platform.api_url}/e2b/envd",
    }


@pytest.fixture
def sbx(platform: Platform) -> Iterator[Sandbox]:
    made = {"metadata": {"suite": "e2b"}, "envs": {"GREETING": "hi"}}
    sandbox = Sandbox.create("base", timeout=600, **made, **opts(platform))
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_commands_foreground_background_stdin_and_kill(sbx: Sandbox) -> None:
    done = sbx.commands.run("echo $GREETING out; echo err >&2; pwd")
    assert done.exit_code == 0 and done.stdout == "hi out\n/root\n" and done.stderr == "err\n"
    assert sbx.commands.run("echo $A", envs={"A": "given"}, cwd="/tmp").stdout == "given\n"
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    seen: list[str] = []
    assert sbx.commands.run("printf 'a\\nb\\n'", on_stdout=seen.append).stdout == "a\nb\n"
    assert "".join(seen) == "a\nb\n"

    # Background: it outlives the handle, is listed, reconnected to, fed and killed.
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "fed\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "fed\n"
    sleeper = sbx.commands.run("sleep 600", background=True)
    sleeper.disconnect()
    assert sleeper.pid in {p.pid for p in sbx.commands.list()}
    again = sbx.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert sleeper.pid not in {p.pid for p in sbx.commands.list()}
    assert sbx.commands.kill(sleeper.pid) is False  # nothing left to kill
    with pytest.raises(NotFoundException):
        sbx.commands.connect(999_999)


def test_files_read_write_list_rename_remove_and_watch(sbx: Sandbox) -> None:
    info = sbx.files.write("/root/notes/a.txt", "hello e2b")
    assert info.path == "/root/notes/a.txt"
    assert sbx.files.read("/root/notes/a.txt") == "hello e2b"
    assert sbx.files.read("notes/a.txt", format="bytes") == b"hello e2b"  # from the home
    sbx.files.write("/root/notes/b.bin", b"\x00\xff" * 1000)
    assert sbx.files.read("/root/notes/b.bin", format="bytes") == b"\x00\xff" * 1000
    written = sbx.files.write_files([{"path": "/root/many/1", "data": "one"},
                                     {"path": "/root/many/2", "data": "two"}])  # fmt: skip
    assert [w.path for w in written] == ["/root/many/1", "/root/many/2"]
    assert sbx.commands.run("cat /root/many/1 /root/many/2").stdout == "onetwo"

    names = {e.name: e for e in sbx.files.list("/root/notes")}
    assert set(names) == {"a.txt", "b.bin"} and names["a.txt"].type == FileType.FILE
    assert names["b.bin"].size == 2000
    deep = {e.path for e in sbx.files.list("/root", depth=2)}
    assert {"/root/notes", "/root/notes/a.txt", "/root/many/2"} <= deep
    assert sbx.files.exists("/root/notes/a.txt") and not sbx.files.exists("/root/none")
    assert sbx.files.get_info("/root/notes").type == FileType.DIR
    assert sbx.files.make_dir("/root/d/e") is True and sbx.files.make_dir("/root/d/e") is False
    moved = sbx.files.rename("/root/notes/a.txt", "/root/d/e/a.txt")
    assert moved.path == "/root/d/e/a.txt" and not sbx.files.exists("/root/notes/a.txt")
    sbx.files.remove("/root/d")
    assert not sbx.files.exists("/root/d/e/a.txt")
    with pytest.raises(SandboxException):  # FileNotFoundException is one
        sbx.files.read("/root/none")
    # Metadata SPACE cannot keep is refused, not dropped: nothing is written.
    with pytest.raises(SandboxException, match="metadata"):
        sbx.files.write("/root/tagged", "x", metadata={"owner": "agent"})
    assert not sbx.files.exists("/root/tagged")

    handle = sbx.files.watch_dir("/root/notes")
    sbx.files.write("/root/notes/new.txt", "x")
    sbx.commands.run("rm /root/notes/b.bin")
    deadline = time.monotonic() + 20
    events: list[Any] = []
    while time.monotonic() < deadline and not {"new.txt", "b.bin"} <= {e.name for e in events}:
        events += handle.get_new_events()
        time.sleep(0.3)
    handle.stop()
    kinds = {(e.name, e.type.value) for e in events}
    assert ("new.txt", "create") in kinds and ("b.bin", "remove") in kinds, kinds


def test_pty(sbx: Sandbox) -> None:
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)

    def drive() -> None:  # as a user at the terminal: type, look, resize, leave
        sbx.pty.send_stdin(term.pid, b"stty size; echo $TERM\n")
        deadline = time.monotonic() + 30
        while b"24 80" not in out and time.monotonic() < deadline:
            time.sleep(0.1)
        sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size; exit\n")

    driver = threading.Thread(target=drive)
    driver.start()
    assert term.wait(on_pty=out.extend).exit_code == 0
    driver.join()
    assert b"24 80" in out and b"xterm-256color" in out and b"40 100" in out, bytes(out)


def test_lifecycle_list_timeout_pause_and_resume(platform: Platform) -> None:
    sbx = Sandbox.create(timeout=600, metadata={"lifecycle": "yes"}, **opts(platform))
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id and info.metadata == {"lifecycle": "yes"}
        assert info.state == SandboxState.RUNNING
        listed = Sandbox.list(query=SandboxQuery(metadata={"lifecycle": "yes"}), **opts(platform))
        assert [s.sandbox_id for s in listed.next_items()] == [sbx.sandbox_id]
        others = Sandbox.list(query=SandboxQuery(metadata={"lifecycle": "no"}), **opts(platform))
        assert others.next_items() == []
        before = info.end_at
        sbx.set_timeout(1200)
        assert sbx.get_info().end_at > before
        sbx.commands.run("echo kept > /root/mark")
        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED and not sbx.is_running()
        query = SandboxQuery(metadata={"lifecycle": "yes"}, state=[SandboxState.PAUSED])
        paused = Sandbox.list(query=query, **opts(platform))
        assert [s.sandbox_id for s in paused.next_items()] == [sbx.sandbox_id]
        back = Sandbox.connect(sbx.sandbox_id, **opts(platform))
        assert back.is_running()
        assert back.commands.run("cat /root/mark").stdout == "kept\n"
    finally:
        assert Sandbox.kill(sbx.sandbox_id, **opts(platform)) is True
    assert Sandbox.kill(sbx.sandbox_id, **opts(platform)) is False


def test_async_sdk_runs_and_watches(platform: Platform) -> None:
    async def main() -> None:
        sbx = await AsyncSandbox.create(timeout=600, **opts(platform))
        try:
            assert (await sbx.commands.run("echo async")).stdout == "async\n"
            await sbx.files.write("/root/w/f", "1")
            seen: list[Any] = []
            handle = await sbx.files.watch_dir("/root/w", on_event=seen.append)
            await sbx.files.write("/root/w/g", "2")
            for _ in range(100):
                if any(e.name == "g" for e in seen):
                    break
                await asyncio.sleep(0.2)
            await handle.stop()
            assert any(e.name == "g" for e in seen), seen
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_tokens_open_only_their_sandbox(platform: Platform, sbx: Sandbox) -> None:
    envd = f"{platform.api_url}/e2b/envd"

    def call(token: str, sandbox_id: str) -> httpx.Response:
        headers = {"E2b-Sandbox-Id": sandbox_id, "X-Access-Token": token}
        return httpx.post(f"{envd}/process.Process/List", json={}, headers=headers, timeout=30)

    token = sbx._envd_access_token
    assert token
    assert call(token, sbx.sandbox_id).status_code == 200
    assert (
        call(token[:-2] + ("AA" if token[-2:] != "AA" else "BB"), sbx.sandbox_id).status_code == 401
    )
    assert call("", sbx.sandbox_id).status_code == 401
    # At the daemon's own host name, as E2B's SDKs reach it under E2B_DOMAIN: the same daemon,
    # for the sandbox the name says, whatever a header claims; nothing else of the API there.
    host = f"49983-{sbx.sandbox_id}.localhost:{urlsplit(platform.api_url).port}"
    at_host = {"Host": host, "X-Access-Token": token, "E2b-Sandbox-Id": "sb-other"}
    sleeper = sbx.commands.run("sleep 300", background=True)
    r = httpx.post(f"{platform.api_url}/process.Process/List", json={}, headers=at_host)
    assert r.status_code == 200, r.text
    assert sleeper.pid in [p["pid"] for p in r.json()["processes"]], r.text
    sleeper.kill()
    assert httpx.get(f"{platform.api_url}/health", headers=at_host).status_code == 204
    assert httpx.get(f"{platform.api_url}/v1/sandboxes", headers=at_host).status_code == 404
    # Another tenant's sandbox, with its own token: neither opens the other's.
    other = Sandbox.create(timeout=300, **opts(platform, platform.key_b))
    try:
        other_token = other._envd_access_token
        assert other_token and call(other_token, sbx.sandbox_id).status_code == 401
        assert call(token, other.sandbox_id).status_code == 401
        with pytest.raises(SandboxException):
            Sandbox.connect(sbx.sandbox_id, **opts(platform, platform.key_b))
        assert Sandbox.kill(sbx.sandbox_id, **opts(platform, platform.key_b)) is False
    finally:
        other.kill()
    with pytest.raises(AuthenticationException):
        Sandbox.create(**opts(platform, "sk-not-a-key"))


def test_revoking_the_key_ends_its_sandboxes_tokens(platform: Platform, sbx: Sandbox) -> None:
    with platform.client() as a, platform.client(platform.admin_key) as admin:
        tenant = a.get("/v1/me").json()["tenant_id"]
        made = admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "e2b"}).json()
        # The same sandbox, connected to with a second key: a token of that key.
        second = Sandbox.connect(sbx.sandbox_id, **opts(platform, made["key"]))
        assert second.commands.run("echo via second").stdout == "via second\n"
        assert admin.delete(f"/v1/tenants/{tenant}/keys/{made['id']}").status_code == 204
        with pytest.raises(AuthenticationException, match="revoked"):
            second.commands.run("echo no more")
        assert sbx.commands.run("echo first still").stdout == "first still\n"


def test_bad_input_is_answered_as_e2b_errors(platform: Platform) -> None:
    api = f"{platform.api_url}/e2b"
    key = {"X-API-Key": platform.key_a}
    for body in ({"templateID": ""}, {"timeout": -1}, {"metadata": "x"}, {"envVars": {"A": 1}}):
        r = httpx.post(f"{api}/v2/sandboxes", json=body, headers=key)
        assert r.status_code in (400, 422), r.text
        assert isinstance(r.json()["code"], int) and r.json()["message"], r.text
    r = httpx.post(f"{api}/v2/sandboxes", content=b"{not json", headers=key)
    assert r.status_code == 422 and r.json()["code"] == 422, r.text
    r = httpx.post(f"{api}/v2/sandboxes", json={"templateID": "none-such"}, headers=key)
    assert r.status_code == 404 and "none-such" in r.json()["message"], r.text
    r = httpx.post(f"{api}/v2/sandboxes", json={"network": {"denyOut": ["10.0.0.0/8"]}},
                   headers=key)  # fmt: skip
    assert r.status_code == 400 and "denyOut" in r.json()["message"], r.text
    # What SPACE's own model refuses is the caller's 400 too, never a 500.
    for body in ({"envVars": {"1A": "x"}}, {"metadata": {"k" * 200: "v"}},
                 {"network": {"allowOut": ["not a host!"]}}):  # fmt: skip
        r = httpx.post(f"{api}/v2/sandboxes", json=body, headers=key)
        assert r.status_code == 400 and r.json()["code"] == 400, r.text
    r = httpx.get(f"{api}/v2/sandboxes")
    assert r.status_code == 401 and "X-API-Key" in r.json()["message"], r.text
    r = httpx.get(f"{api}/v2/sandboxes", params={"state": "killed"}, headers=key)
    assert r.status_code == 400 and "state" in r.json()["message"], r.text
    r = httpx.get(f"{api}/v2/sandboxes", params={"nextToken": "garbage"}, headers=key)
    assert r.status_code == 400, r.text
    r = httpx.get(f"{api}/sandboxes/sb-none", headers=key)
    assert r.status_code == 404 and r.json()["code"] == 404, r.text
    # The daemon: no sandbox named, or a body that is not the message.
    r = httpx.post(f"{api}/envd/process.Process/List", json={})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text


def test_the_daemon_refuses_bad_input_plainly(platform: Platform, sbx: Sandbox) -> None:
    envd = f"{platform.api_url}/e2b/envd"
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token or ""}
    # A user name is a name, not a way out of /home.
    r = httpx.get(f"{envd}/files", params={"path": "x", "username": "../../etc"}, headers=headers)
    assert r.status_code == 422, r.text
    # A gzip body cut short is not written as if whole.
    data = os.urandom(100_000)  # (repeated bytes would fit 200 bytes of gzip whole)
    whole = gzip.compress(data)
    cut = {**headers, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}
    r = httpx.post(f"{envd}/files", params={"path": "/root/cut"}, content=whole[:200],
                   headers=cut)  # fmt: skip
    assert r.status_code == 400 and "gzip" in r.json()["message"], r.text
    r = httpx.post(f"{envd}/files", params={"path": "/root/whole"}, content=whole, headers=cut)
    assert r.status_code == 200, r.text
    assert sbx.files.read("/root/whole", format="bytes") == data
    assert not sbx.files.exists("/root/cut")
    # A file the guest dated past what a timestamp holds is still listed.
    sbx.commands.run("touch -d @100000000000000 /root/future")
    assert "future" in {e.name for e in sbx.files.list("/root")}

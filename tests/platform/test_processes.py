"""Background processes through the API and the SDK, in real VMs: they outlive their stream,
a suspend and a resume; they keep their output for whoever connects next; they take input,
signals and terminal sizes unfollowed; and nobody else's key reaches them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from httpx_ws import connect_ws

import space

from ..stack import Platform

pytestmark = pytest.mark.vm
PROCESS_KEYS = {"pid", "tag", "command", "cwd", "pty", "background", "started_at", "running",
                "exit_code", "signal"}  # fmt: skip


def _wait_ended(sb: space.Sandbox, ref: str | int, bound_s: float = 30) -> space.ProcessInfo:
    deadline = time.monotonic() + bound_s
    while (info := sb.processes.get(ref)).running:
        assert time.monotonic() < deadline, f"{ref} still runs after {bound_s}s"
        time.sleep(0.2)
    return info


def test_a_background_process_outlives_its_stream_and_a_suspend(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client, env={"WHO": "bg"}) as sb,
    ):
        script = 'echo "start $WHO"; read line; echo "got $line"; sleep 1; echo done >&2; exit 5'
        stream = sb.exec_stream(script, tag="worker-1", keep_stdin=True)
        with stream:
            first = next(stream)
        assert first == ("stdout", b"start bg\n") and stream.pid is not None
        # Nobody follows it now: it runs on, listed with its tag.
        listed = {p.tag: p for p in sb.processes.list()}
        assert listed["worker-1"].running and listed["worker-1"].pid == stream.pid
        assert listed["worker-1"].command == script and listed["worker-1"].background

        assert sb.suspend().state == "suspended"
        assert sb.resume().state == "running"
        sb.processes.send_stdin("worker-1", "hello\n")
        seen: list[bytes] = []
        result = sb.processes.wait("worker-1", on_stdout=seen.append)
        # What it wrote while nobody followed (across the suspend too) is all there.
        assert result.stdout == b"start bg\ngot hello\n" and result.stderr == b"done\n"
        assert result.exit_code == 5 and b"".join(seen) == result.stdout
        ended = sb.processes.get(stream.pid)
        assert (ended.running, ended.exit_code) == (False, 5)
        # A connect after its end replays the output and the result at once.
        with sb.processes.connect("worker-1") as again:
            replayed = [(name, data) for name, data in again]
        assert b"".join(d for name, d in replayed if name == "stdout") == b"start bg\ngot hello\n"
        assert b"".join(d for name, d in replayed if name == "stderr") == b"done\n"
        assert again.result.exit_code == 5


def test_start_input_signals_and_a_foreground_stream_left(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        cat = sb.processes.start(["cat"], tag="cat", keep_stdin=True, stdin=b"first ")
        assert cat.running and cat.tag == "cat" and cat.command == ["cat"]
        sb.processes.send_stdin(cat, b"second\n", eof=True)
        result = sb.processes.wait("cat")
        assert (result.stdout, result.exit_code) == (b"first second\n", 0)

        sleeper = sb.processes.start("trap 'echo term; exit 3' TERM; sleep 60 & wait")
        time.sleep(0.5)  # its trap is set
        sb.processes.signal(sleeper.pid, signal.SIGTERM)
        assert sb.processes.wait(sleeper.pid).exit_code == 3
        killed = sb.processes.start(["sleep", "60"], tag="sleeper")
        sb.processes.kill("sleeper")
        assert _wait_ended(sb, killed.pid).signal == signal.SIGKILL

        # A foreground command whose stream is left is killed, as before.
        fg = sb.exec_stream("echo up; sleep 60")
        with fg:
            assert next(fg) == ("stdout", b"up\n")
        deadline = time.monotonic() + 15
        while fg.pid in [p.pid for p in sb.processes.list()]:
            assert time.monotonic() < deadline, "a left foreground command must be killed"
            time.sleep(0.2)


def test_a_pty_process_followed_over_the_websocket(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        body = {"cmd": "read x; stty size; echo \"x=$x\"", "pty": True, "rows": 10, "cols": 40,
                "tag": "term"}  # fmt: skip
        started = client._http.post(f"/v1/sandboxes/{sb.id}/processes", json=body).json()
        assert started["pty"] is True
        sb.processes.resize("term", 33, 77)
        url = (
            platform.api_url.replace("http://", "ws://")
            + f"/v1/sandboxes/{sb.id}/processes/term/ws"
        )
        headers = {"Authorization": f"Bearer {platform.key_a}"}
        out = b""
        with httpx.Client() as http, connect_ws(url, http, headers=headers) as ws:
            assert json.loads(ws.receive_text())["type"] == "start"
            ws.send_bytes(b"typed\r")
            while True:
                message = ws.receive()
                if hasattr(message, "data") and isinstance(message.data, bytes | bytearray):
                    out += bytes(message.data)[1:]
                    continue
                event = json.loads(message.data)
                if event["type"] == "exit":
                    break
        assert b"33 77" in out and b"x=typed" in out


def test_processes_are_the_tenants_own_and_bad_input_is_refused(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
        space.Space(platform.api_url, platform.key_b) as other,
    ):
        mine = sb.processes.start(["sleep", "60"], tag="mine")
        theirs = space.Processes(other, sb.id)
        with pytest.raises(space.NotFoundError):
            theirs.list()
        with pytest.raises(space.NotFoundError):
            theirs.kill("mine")
        with pytest.raises(space.NotFoundError):
            theirs.send_stdin(mine.pid, b"x")
        assert sb.processes.get("mine").running  # untouched by the other key

        with pytest.raises(space.ConflictError):  # one running process per tag
            sb.processes.start(["true"], tag="mine")
        for tag in ("12", "..", "a/b", "x" * 65):
            with pytest.raises(space.ValidationError):
                sb.processes.start(["true"], tag=tag)
        with pytest.raises(space.NotFoundError):
            sb.processes.get("nobody")
        with pytest.raises(space.NotFoundError):
            sb.processes.get(999999)
        with pytest.raises(space.ValidationError):
            sb.processes.signal("mine", 0)
        with pytest.raises(space.ValidationError):  # started without keep_stdin
            sb.processes.send_stdin("mine", b"x")
        raw = httpx.post(
            f"{platform.api_url}/v1/sandboxes/{sb.id}/processes/mine/stdin",
            content=b"x" * (17 << 20),
            headers={"Authorization": f"Bearer {platform.key_a}"},
            timeout=60,
        )
        assert raw.status_code == 413 and str(16 << 20) in raw.text, raw.text
        sb.processes.kill("mine")


async def test_async_processes(platform: Platform) -> None:
    async with space.AsyncSpace(platform.api_url, platform.key_a) as client:
        sb = await space.AsyncSandbox.create(client=client)
        try:
            info = await sb.processes.start(
                "for i in 1 2 3; do echo $i; sleep 0.3; done", tag="count"
            )
            assert info.running
            chunks = []
            async with sb.processes.connect("count", replay=False) as stream:
                async for _, data in stream:
                    chunks.append(data)
            assert b"".join(chunks).endswith(b"3\n") and stream.result.exit_code == 0
            assert [p.tag for p in await sb.processes.list() if p.tag == "count"] == ["count"]
        finally:
            await sb.delete()


def test_cli_background_ps_attach_stdin_kill(platform: Platform) -> None:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}

    def space_cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "space.cli.main", *args], env=env,
                              input=stdin, capture_output=True, timeout=300)  # fmt: skip

    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        started = space_cli("exec", sb.id, "--tag", "echo", "--keep-stdin", "-n", "--",
                            "sh", "-c", "read x; echo \"read $x\"; exit 4")  # fmt: skip
        assert started.returncode == 0, started.stderr
        pid = int(started.stdout)
        listed = space_cli("process", "ls", sb.id)
        assert listed.returncode == 0 and f"{pid}" in listed.stdout.decode()
        assert "echo" in listed.stdout.decode() and "running" in listed.stdout.decode()
        as_json = json.loads(space_cli("process", "ls", sb.id, "--json").stdout)
        assert [set(p) for p in as_json if p["pid"] == pid] == [PROCESS_KEYS]  # docs/cli.md
        fed = space_cli("process", "stdin", sb.id, "echo", "--eof", stdin=b"this\n")
        assert fed.returncode == 0, fed.stderr
        followed = space_cli("process", "attach", sb.id, str(pid))
        assert (followed.returncode, followed.stdout) == (4, b"read this\n")

        assert space_cli("exec", sb.id, "-d", "-n", "--", "sleep", "60").returncode == 0
        sleeper = next(p for p in sb.processes.list() if p.command == ["sleep", "60"])
        assert space_cli("process", "kill", sb.id, str(sleeper.pid), "-s", "TERM").returncode == 0
        assert _wait_ended(sb, sleeper.pid).signal == signal.SIGTERM
        bad = space_cli("process", "kill", sb.id, "echo", "-s", "NOPE")
        assert bad.returncode == 2 and b"not a signal" in bad.stderr
        gone = space_cli("process", "attach", sb.id, "nobody")
        assert gone.returncode == 1 and b"Traceback" not in gone.stderr

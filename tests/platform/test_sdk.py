"""The Python SDK (sync and async) and the `space` CLI against the real stack."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import space

from ..stack import Platform
from .helpers import FETCH

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    ">/dev/null 2>&1 & echo $!"
)


def _advances(sb: space.Sandbox) -> bool:
    first = sb.exec("cat /tmp/counter").stdout
    for _ in range(30):
        time.sleep(0.2)
        if sb.exec("cat /tmp/counter").stdout != first:
            return True
    return False


def test_sync_sdk_full_lifecycle(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client, env={"WHO": "sdk"}, metadata={"via": "sdk"}) as sb,
    ):
        assert sb.state == "running"
        seen: list[bytes] = []
        r = sb.exec('echo "$WHO"; echo err >&2; exit 4', on_stdout=seen.append)
        assert (r.stdout, r.stderr, r.exit_code, r.ok) == (b"sdk\n", b"err\n", 4, False)
        assert b"".join(seen) == b"sdk\n"
        assert sb.exec(["sha256sum"], stdin=b"abc").stdout.startswith(
            hashlib.sha256(b"abc").hexdigest().encode()
        )

        blob = os.urandom(5 << 20)
        assert sb.files.write("/root/blob", blob) == len(blob)
        assert hashlib.sha256(sb.files.read("/root/blob")).digest() == hashlib.sha256(blob).digest()
        assert "blob" in [e.name for e in sb.files.list("/root")]
        with pytest.raises(space.NotFoundError):
            sb.files.read("/does/not/exist")

        pid = int(sb.exec(COUNTER).stdout)
        assert sb.pause().state == "paused"
        with pytest.raises(space.ConflictError) as e:
            sb.pause()
        assert e.value.state == "paused"
        assert sb.resume().state == "running"
        assert sb.suspend().state == "suspended"
        assert sb.resume().state == "running"
        assert sb.exec(["kill", "-0", str(pid)]).ok, "the process must survive suspend/resume"
        assert _advances(sb)
        assert sb.files.read("/root/blob") == blob
        sid = sb.id
    with space.Space(platform.api_url, platform.key_a) as client:
        assert space.Sandbox.get(sid, client=client).state == "deleted"  # the `with` deleted it


async def test_async_sdk_streams_and_files(platform: Platform) -> None:
    async with space.AsyncSpace(platform.api_url, platform.key_a) as client:
        sb = await space.AsyncSandbox.create(client=client)
        try:
            chunks = []
            stream = sb.exec_stream("for i in 1 2 3; do echo $i; sleep 0.2; done")
            async with stream:
                async for kind, data in stream:
                    chunks.append((kind, data, time.monotonic()))
            assert b"".join(d for _, d, _ in chunks) == b"1\n2\n3\n"
            assert chunks[-1][2] - chunks[0][2] > 0.2, "output must stream, not arrive at the end"
            assert stream.result is not None and stream.result.exit_code == 0
            await sb.files.write("/root/a.txt", "text")
            assert await sb.files.read("/root/a.txt") == b"text"
            await sb.files.write("/root/b.txt", "other")
            with pytest.raises(space.ConflictError):  # an existing target is kept
                await sb.files.rename("/root/a.txt", "/root/b.txt")
            moved = await sb.files.rename("/root/a.txt", "/root/b.txt", overwrite=True)
            assert (moved.name, moved.size) == ("b.txt", 4)
            assert await sb.files.read("/root/b.txt") == b"text"
            with pytest.raises(space.NotFoundError):
                await sb.files.read("/root/a.txt")
            with pytest.raises(space.ValidationError):  # across file systems (/proc here)
                await sb.files.rename("/root/b.txt", "/proc/b.txt")
            async with space.AsyncSpace(platform.api_url, platform.key_b) as other:
                theirs = space.AsyncFiles(other, sb.id)  # another tenant's key moves nothing
                with pytest.raises(space.NotFoundError):
                    await theirs.rename("/root/b.txt", "/root/c.txt")
            assert (await sb.files.stat("/root/b.txt")).size == 4
        finally:
            await sb.delete()


def test_sdk_errors_are_typed(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, "sk_space_nope_nope") as bad,
        pytest.raises(space.AuthenticationError),
    ):
        space.Sandbox.get("sb-anything", client=bad)
    with space.Space(platform.api_url, platform.key_b) as other, pytest.raises(space.NotFoundError):
        space.Sandbox.get("sb-0000000000000000", client=other)
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        pytest.raises(space.ValidationError),
    ):
        space.Sandbox.create(client=client, vcpus=0)


def test_cli_create_exec_cp_rm(platform: Platform, tmp_path: Path) -> None:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
    cli = [sys.executable, "-m", "space.cli.main"]

    def space_cli(*args: str, **kw: object) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*cli, *args], env=env, capture_output=True, timeout=300, stdin=subprocess.DEVNULL, **kw
        )  # type: ignore[call-overload, no-any-return]

    made = space_cli("sandbox", "create")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.decode().split()[0]
    try:
        r = space_cli("exec", sid, "--", "sh", "-c", "echo out; echo err >&2; exit 5")
        assert (r.returncode, r.stdout, r.stderr) == (5, b"out\n", b"err\n")
        src = tmp_path / "up.bin"
        src.write_bytes(os.urandom(2 << 20))
        assert space_cli("cp", str(src), f"{sid}:/root/up.bin").returncode == 0
        back = tmp_path / "down.bin"
        assert space_cli("cp", f"{sid}:/root/up.bin", str(back)).returncode == 0
        assert back.read_bytes() == src.read_bytes()
        listing = space_cli("sandbox", "ls")
        assert sid in listing.stdout.decode()
        missing = space_cli("exec", "sb-nonexistent", "--", "true")
        assert missing.returncode != 0 and b"Traceback" not in missing.stderr
    finally:
        assert space_cli("sandbox", "rm", sid).returncode == 0


def test_cli_shell_is_an_interactive_pty(platform: Platform) -> None:
    with space.Space(platform.api_url, platform.key_a) as client:
        sb = space.Sandbox.create(client=client)
        try:
            env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
            pid, fd = pty.fork()
            if pid == 0:  # the child: `space shell` on a real terminal
                os.execve(
                    sys.executable, [sys.executable, "-m", "space.cli.main", "shell", sb.id], env
                )
            out = b""

            def read_until(marker: bytes, timeout: float = 60) -> None:
                nonlocal out
                deadline = time.monotonic() + timeout
                while marker not in out and time.monotonic() < deadline:
                    if select.select([fd], [], [], 0.5)[0]:
                        try:
                            out += os.read(fd, 4096)
                        except OSError:
                            break
                assert marker in out, out[-500:]

            read_until(b"#")  # a root prompt from the sandbox
            os.write(fd, b"echo $((40+2)) from $(hostname); tty\n")
            read_until(f"42 from {sb.id}".encode())
            read_until(b"/dev/pts/")
            os.write(fd, b"exit 7\n")
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 7
        finally:
            sb.delete()


def test_secrets_egress_and_audit_from_the_sdk_and_the_cli(platform: Platform) -> None:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
    name, value = f"cli-{os.urandom(3).hex()}", f"v-{os.urandom(8).hex()}"

    def space_cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "space.cli.main", *args], env=env,
                              input=stdin, capture_output=True, timeout=300)  # fmt: skip

    assert space_cli("secret", "set", name, stdin=value.encode() + b"\n").returncode == 0
    assert space_cli("secret", "set", "empty", stdin=b"").returncode == 2  # a usage error
    listed = json.loads(space_cli("secret", "ls", "--json").stdout)
    assert name in {s["name"] for s in listed} and value not in json.dumps(listed)
    with space.Space(platform.api_url, platform.key_a) as client:
        assert name in {s.name for s in client.secrets()}
        with space.Space(platform.api_url, platform.key_b) as other:
            assert name not in {s.name for s in other.secrets()}  # a tenant's own
        made = space_cli("sandbox", "create", "--secret", f"{name}:TOKEN:secret.test",
                         "--allow", "secret.test")  # fmt: skip
        assert made.returncode == 0, made.stderr
        sid = made.stdout.decode().split()[0]
        try:
            sb = space.Sandbox.get(sid, client=client)
            held = sb.exec('printf %s "$TOKEN"').text
            assert held.startswith("space-secret-") and value not in held  # a placeholder only
            refused = space_cli("secret", "rm", name)  # bound to a live sandbox
            assert refused.returncode != 0 and b"409" in refused.stderr, refused.stderr
            assert sb.exec(["python3", "-c", FETCH, "http://allowed.test/"]).exit_code == 3
            opened = space_cli("sandbox", "network", sid, "--allow", "allowed.test")
            assert opened.returncode == 0, opened.stderr
            fetched = sb.exec(["python3", "-c", FETCH, "http://allowed.test/"])
            assert fetched.exit_code == 0, fetched.text
            trail = json.loads(space_cli("sandbox", "audit", sid, "--json").stdout)
            decided = [(e["host"], e["decision"]) for e in trail]
            denied, allowed = ("allowed.test", "deny"), ("allowed.test", "allow")
            assert denied in decided and allowed in decided
            assert decided.index(denied) < decided.index(allowed), decided
            assert space_cli("sandbox", "network", "sb-nope", "--allow", "x.test").returncode != 0
            bad = space_cli("sandbox", "create", "--secret", "no-hosts:VAR")
            assert bad.returncode == 2 and b"NAME:VAR:HOST" in bad.stderr
        finally:
            sb.delete()
        assert space_cli("secret", "rm", name).returncode == 0
        assert name not in {s.name for s in client.secrets()}

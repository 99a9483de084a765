"""The guest agent's behaviour, served over a unix socket by a real agent process on the host.

The same agent runs as PID 1 in every VM (tests/vm prove that end to end); here its semantics
are checked quickly and in detail: streams, exit statuses, stdin, signals, timeouts, PTYs, files
and authentication.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from space.worker.agent_client import AgentAuthError, AgentClient, AgentError


async def test_stdout_and_stderr_are_separate_and_exit_code_reported(agent: AgentClient) -> None:
    r = await agent.run("echo out; echo err >&2; echo out2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code, r.signal) == (b"out\nout2\n", b"err\n", 7, None)


async def test_death_by_signal_is_reported(agent: AgentClient) -> None:
    r = await agent.run("kill -SEGV $$")
    assert (r.exit_code, r.signal) == (None, signal.SIGSEGV)


async def test_signal_delivered_to_running_process(agent: AgentClient) -> None:
    proc = await agent.exec(["sleep", "30"])
    await proc.signal(signal.SIGTERM)
    r = await proc.wait()
    assert r.signal == signal.SIGTERM


async def test_stdin_is_piped(agent: AgentClient) -> None:
    data = os.urandom(3 << 20)
    r = await agent.run("sha256sum", input=data)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_timeout_kills_and_says_so(agent: AgentClient) -> None:
    r = await agent.run(["sleep", "30"], timeout=0.3)
    assert r.timed_out and r.signal == signal.SIGKILL and r.exit_code is None


async def test_env_cwd_and_user(agent: AgentClient, tmp_path: Path) -> None:
    r = await agent.run('echo "$GREETING $(pwd) $(id -un)"', env={"GREETING": "hi"},
                        cwd=str(tmp_path), user="nobody")  # fmt: skip
    assert r.stdout.decode().strip() == f"hi {tmp_path} nobody"


async def test_bad_exec_requests_get_clear_errors(agent: AgentClient) -> None:
    with pytest.raises(AgentError, match="executable not found: /no/such") as e:
        await agent.run(["/no/such"])
    assert e.value.code == "not_found"
    with pytest.raises(AgentError, match="working directory does not exist"):
        await agent.run("true", cwd="/no/such/dir")
    with pytest.raises(AgentError, match="no such user"):
        await agent.run("true", user="no-such-user")
    with pytest.raises(AgentError, match="argv"):
        await agent.call("exec", argv=[])
    with pytest.raises(AgentError, match="unknown operation"):
        await agent.call("format_disk")


async def test_background_child_does_not_hold_the_exec_open(agent: AgentClient) -> None:
    r = await agent.run("sleep 30 & echo started", timeout=10)
    assert r.stdout == b"started\n" and r.exit_code == 0 and r.duration_ms < 5000


async def test_pty_with_resize(agent: AgentClient) -> None:
    proc = await agent.exec(["sh", "-c", "stty size; read x; stty size"], pty=True,
                            rows=30, cols=100)  # fmt: skip
    out = b""
    async for _, data in proc:
        out += data
        if b"30 100" in out and b"41 132" not in out:
            await proc.resize(41, 132)
            await proc.write(b"\n")
    r = await proc.wait()
    assert r.exit_code == 0
    assert b"30 100" in out and b"41 132" in out


async def test_concurrent_execs_share_one_connection(agent: AgentClient) -> None:
    results = await asyncio.gather(*(agent.run(f"sleep 0.2; echo {i}") for i in range(20)))
    assert [r.stdout for r in results] == [f"{i}\n".encode() for i in range(20)]


async def test_files_round_trip_and_errors(agent: AgentClient, tmp_path: Path) -> None:
    data = os.urandom(5 << 20)
    path = str(tmp_path / "sub" / "blob")
    with pytest.raises(AgentError) as e:
        await agent.write_file(path, data)
    assert e.value.code == "not_found"
    assert await agent.write_file(path, data, mode=0o600, make_parents=True) == len(data)
    assert hashlib.sha256(await agent.read_file(path)).digest() == hashlib.sha256(data).digest()
    st = await agent.stat(path)
    assert (st["type"], st["size"], st["mode"]) == ("file", len(data), 0o600)
    assert [e["name"] for e in await agent.list_dir(str(tmp_path / "sub"))] == ["blob"]
    with pytest.raises(AgentError) as e:
        await agent.read_file(str(tmp_path / "missing"))
    assert e.value.code == "not_found"
    with pytest.raises(AgentError) as e:
        await agent.read_file(str(tmp_path))
    assert e.value.code == "is_a_directory"
    with pytest.raises(AgentError) as e:
        await agent.remove(str(tmp_path / "sub"))
    assert e.value.code == "not_empty"
    with pytest.raises(AgentError, match="absolute"):
        await agent.stat("relative/path")
    await agent.remove(str(tmp_path / "sub"), recursive=True)
    assert not (tmp_path / "sub").exists()
    await agent.mkdir(str(tmp_path / "a" / "b"), parents=True)
    assert (tmp_path / "a" / "b").is_dir()


async def test_rename_is_one_step_and_replaces_only_when_asked(
    agent: AgentClient, tmp_path: Path
) -> None:
    (tmp_path / "a").write_bytes(b"first")
    (tmp_path / "b").write_bytes(b"second")
    moved = await agent.rename(str(tmp_path / "a"), str(tmp_path / "c"))
    assert (moved["name"], moved["type"], moved["size"]) == ("c", "file", 5)
    assert not (tmp_path / "a").exists() and (tmp_path / "c").read_bytes() == b"first"
    with pytest.raises(AgentError) as e:  # an existing target is kept unless asked
        await agent.rename(str(tmp_path / "c"), str(tmp_path / "b"))
    assert e.value.code == "exists" and (tmp_path / "b").read_bytes() == b"second"
    await agent.rename(str(tmp_path / "c"), str(tmp_path / "b"), overwrite=True)
    assert (tmp_path / "b").read_bytes() == b"first" and not (tmp_path / "c").exists()
    (tmp_path / "d" / "e").mkdir(parents=True)
    assert (await agent.rename(str(tmp_path / "d"), str(tmp_path / "f")))["type"] == "directory"
    for source, to, code in (
        (tmp_path / "missing", tmp_path / "x", "not_found"),
        (tmp_path / "f", tmp_path / "f" / "e" / "inside", "invalid"),
        (tmp_path / "b", Path("/"), "invalid"),
    ):
        with pytest.raises(AgentError) as e:
            await agent.rename(str(source), str(to))
        assert e.value.code == code, (source, to, e.value)
    with pytest.raises(AgentError, match="absolute"):
        await agent.rename(str(tmp_path / "b"), "relative")


async def test_failed_write_leaves_old_file_intact(agent: AgentClient, tmp_path: Path) -> None:
    target = tmp_path / "keep"
    target.write_bytes(b"original")

    async def broken() -> AsyncIterator[bytes]:
        yield b"partial"
        raise RuntimeError("the upload broke")

    with pytest.raises(RuntimeError):
        await agent.write_file(str(target), broken())
    assert target.read_bytes() == b"original"


async def test_wrong_token_is_refused(agent_socket: Path) -> None:
    with pytest.raises(AgentAuthError):
        await AgentClient.connect(
            lambda: asyncio.open_unix_connection(str(agent_socket)), "wrong-token", timeout=5
        )


async def test_requests_before_hello_are_ignored(agent_socket: Path) -> None:
    from space.guest import protocol as p

    reader, writer = await asyncio.open_unix_connection(str(agent_socket))
    writer.write(p.encode_json(p.FrameType.REQUEST, 1, {"op": "exec", "cmd": "touch /tmp/x"}))
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.5)
    writer.close()


async def test_identity_changes_refused_outside_a_vm(agent: AgentClient) -> None:
    with pytest.raises(AgentError, match="inside a VM"):
        await agent.refresh_identity(hostname="nope")


async def test_a_slow_reader_pushes_back_instead_of_filling_memory(agent: AgentClient) -> None:
    from space.worker.agent_client import BUFFER_HIGH

    size = 6 * BUFFER_HIGH
    proc = await agent.exec(["head", "-c", str(size), "/dev/zero"])
    await asyncio.sleep(1.0)  # nobody reads: the client must stop taking from the agent
    assert agent._buffered <= BUFFER_HIGH + (1 << 20)
    got = 0
    async for _, data in proc:
        got += len(data)
    assert got == size
    assert (await proc.wait()).exit_code == 0


async def test_an_abandoned_stream_does_not_block_the_connection(agent: AgentClient) -> None:
    proc = await agent.exec(["sh", "-c", "head -c 200000000 /dev/zero; sleep 30"])
    await asyncio.sleep(0.5)
    proc.discard()
    await proc.signal(signal.SIGKILL)
    r = await asyncio.wait_for(agent.run("echo still here"), 10)
    assert r.stdout == b"still here\n"

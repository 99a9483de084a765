"""Files in and out of a real VM."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import pytest

from space.worker.agent_client import AgentError
from space.worker.machine import Machine

pytestmark = pytest.mark.vm


async def test_fifty_megabytes_round_trip(machine: Machine) -> None:
    size = 50 << 20
    digest = hashlib.sha256()

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(size // (1 << 20)):
            block = os.urandom(1 << 20)
            digest.update(block)
            yield block

    assert await machine.agent.write_file("/root/blob", chunks()) == size
    r = await machine.agent.run(["sha256sum", "/root/blob"])
    assert r.stdout.split()[0].decode() == digest.hexdigest()
    back = hashlib.sha256()
    async for chunk in machine.agent.iter_file("/root/blob"):
        back.update(chunk)
    assert back.hexdigest() == digest.hexdigest()
    await machine.agent.remove("/root/blob")


async def test_missing_paths_give_clear_errors(machine: Machine) -> None:
    for call in (
        machine.agent.read_file("/no/such/file"),
        machine.agent.stat("/no/such/file"),
        machine.agent.list_dir("/no/such/dir"),
        machine.agent.remove("/no/such/file"),
        machine.agent.write_file("/no/such/dir/file", b"x"),
    ):
        with pytest.raises(AgentError, match="/no/such") as e:
            await call
        assert e.value.code == "not_found"


async def test_list_stat_mkdir(machine: Machine) -> None:
    await machine.agent.mkdir("/srv/a/b", parents=True)
    await machine.agent.write_file("/srv/a/b/f.txt", b"hello", mode=0o640)
    entries = await machine.agent.list_dir("/srv/a/b")
    assert [(e["name"], e["type"], e["size"], e["mode"]) for e in entries] == [
        ("f.txt", "file", 5, 0o640)
    ]
    assert (await machine.agent.stat("/srv/a"))["type"] == "directory"
    r = await machine.agent.run("cat /srv/a/b/f.txt")
    assert r.stdout == b"hello"

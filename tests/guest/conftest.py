"""A real agent process on the host, serving a unix socket (`--listen-unix`), and a client."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from space.worker.agent_client import AgentClient

TOKEN = "test-token-0123456789abcdef"


@dataclass(frozen=True)
class AgentProcess:
    socket: Path
    pid: int
    log: Path

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def agent_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentProcess]:
    tmp = tmp_path_factory.mktemp("agent")
    sock, token_file, log = tmp / "agent.sock", tmp / "token", tmp / "agent.log"
    token_file.write_text(TOKEN)
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "space.guest.agent", "--listen-unix", str(sock),
             "--token-file", str(token_file)],
            stderr=log_file,
        )  # fmt: skip
    deadline = time.monotonic() + 10
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    yield AgentProcess(sock, proc.pid, log)
    proc.terminate()
    proc.wait(5)


@pytest.fixture(scope="module")
def agent_socket(agent_process: AgentProcess) -> Path:
    return agent_process.socket


@pytest.fixture
async def agent(agent_socket: Path) -> AsyncIterator[AgentClient]:
    client = await AgentClient.connect(
        lambda: asyncio.open_unix_connection(str(agent_socket)), TOKEN, timeout=5
    )
    yield client
    await client.close()

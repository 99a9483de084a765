"""The gateway as a child process of the worker: start it, wait until it answers, stop it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from space.gateway.client import GatewayClient, GatewayError


@dataclass(frozen=True)
class GatewaySettings:
    state_dir: Path
    control_socket: Path
    upstream_dns: str  # HOST[:PORT]
    upstream_ca: Path | None = None
    proxy_port: int = 15001
    dns_port: int = 15053
    max_connections: int = 512
    user: str | None = None  # drop root to this user once started (recommended)
    die_with: int | None = None  # a pid: the gateway ends when that process does (its worker)

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "space.gateway",
                "--state-dir", str(self.state_dir),
                "--control-socket", str(self.control_socket),
                "--upstream-dns", self.upstream_dns,
                "--proxy-port", str(self.proxy_port), "--dns-port", str(self.dns_port),
                "--max-connections", str(self.max_connections)]  # fmt: skip
        if self.upstream_ca is not None:
            argv += ["--upstream-ca", str(self.upstream_ca)]
        if self.user is not None:
            argv += ["--user", self.user]
        if self.die_with is not None:
            argv += ["--die-with", str(self.die_with)]
        return argv


class GatewayProcess:
    """One worker's gateway. Its log goes to `<state_dir>/gateway.log`."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self, timeout: float = 20.0) -> GatewayClient:
        """Start it and return a client once it answers; raises GatewayError if it does not."""
        s = self.settings
        s.state_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            s.control_socket.unlink()  # a stale socket would look like a live gateway
        log = s.state_dir / "gateway.log"
        with log.open("ab") as out:
            self._proc = await asyncio.create_subprocess_exec(
                *s.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True,
            )  # fmt: skip
        client = GatewayClient(s.control_socket)
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.returncode is not None:
                await client.close()
                tail = log.read_text(errors="replace")[-1500:]
                raise GatewayError(f"the gateway exited with {self._proc.returncode}: {tail}")
            if s.control_socket.exists():
                try:
                    await client.health()
                    return client
                except GatewayError:
                    pass
            if time.monotonic() > deadline:
                await client.close()
                await self.stop()
                raise GatewayError(f"the gateway did not answer within {timeout:.0f} s")
            await asyncio.sleep(0.05)

    async def stop(self, timeout: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

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
    ca_dir: Path | None = None  # the deployment's CA; None: <state_dir>/ca, made once
    proxy_port: int = 15001
    dns_port: int = 15053
    max_connections: int = 512  # per sandbox (at most half the total)
    max_total_connections: int = 8192
    head_timeout: float = 10.0  # a ClientHello or request head must be whole by then (seconds)
    idle_timeout: float = 60.0  # bodies, splices, keep-alive: closed when nothing moved that long
    dns_rate: float = 100.0  # queries a second per sandbox; REFUSED beyond (a burst is allowed)
    dns_burst: int = 200
    audit_ring: int = 1000  # events in memory per sandbox
    audit_rings: int = 256  # sandboxes in memory
    audit_file_bytes: int = 64 << 20  # <state_dir>/audit/audit.jsonl is rotated past this
    audit_files: int = 5  # rotated files kept
    user: str | None = None  # drop root to this user once started (recommended)
    die_with: int | None = None  # a pid: the gateway ends when that process does (its worker)
    pid_file: Path | None = None  # where its pid is kept, for whoever must stop a stale one
    open_networks: tuple[str, ...] = ()  # private networks policies may reach
    closed_networks: tuple[str, ...] = ()  # never dialled: the sandboxes' own ranges

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "space.gateway",
                "--state-dir", str(self.state_dir),
                "--control-socket", str(self.control_socket),
                "--upstream-dns", self.upstream_dns,
                "--proxy-port", str(self.proxy_port), "--dns-port", str(self.dns_port),
                "--max-connections", str(self.max_connections),
                "--max-total-connections", str(self.max_total_connections),
                "--head-timeout", str(self.head_timeout),
                "--idle-timeout", str(self.idle_timeout),
                "--dns-rate", str(self.dns_rate), "--dns-burst", str(self.dns_burst),
                "--audit-ring", str(self.audit_ring), "--audit-rings", str(self.audit_rings),
                "--audit-file-bytes", str(self.audit_file_bytes),
                "--audit-files", str(self.audit_files)]  # fmt: skip
        if self.upstream_ca is not None:
            argv += ["--upstream-ca", str(self.upstream_ca)]
        if self.ca_dir is not None:
            argv += ["--ca-dir", str(self.ca_dir)]
        if self.user is not None:
            argv += ["--user", self.user]
        if self.die_with is not None:
            argv += ["--die-with", str(self.die_with)]
        for network in self.open_networks:
            argv += ["--open-network", network]
        for network in self.closed_networks:
            argv += ["--closed-network", network]
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
        if s.pid_file is not None:
            s.pid_file.write_text(str(self._proc.pid))
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

    async def wait(self) -> int:
        """Until the gateway process exits (for whatever reason); its exit status."""
        if self._proc is None:
            raise GatewayError("the gateway was not started")
        return await self._proc.wait()

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

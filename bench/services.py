"""The whole platform for a benchmark: embedded PostgreSQL, one worker, controller, API.

Every service is its own `space` process, as in production; the worker can be restarted with
other settings between phases (e.g. base snapshots off, for cold boots). More workers can be
added as hosts of their own: each with a pool directory of its own, sharing nothing on disk.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from space.db import embedded, migrate
from space.db.store import Store, connect
from space.worker import netsetup
from space.worker.local import local_runtime

SPACE = [sys.executable, "-m", "space.cli.main"]
HOSTS = Path("/var/lib/space/pool/hosts")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class BenchPlatform:
    url: str  # the API's
    database_url: str
    env: dict[str, str]
    worker_id: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    hosts: list[str] = field(default_factory=list)  # workers added with pools of their own

    def start(self, name: str, *argv: str) -> None:
        self.procs[name] = subprocess.Popen([*SPACE, *argv], env=self.env, stderr=self._log(name))

    def _log(self, name: str) -> Any:
        """SPACE_BENCH_LOGS=DIR keeps each service's log there (a run that broke says why)."""
        logs = os.environ.get("SPACE_BENCH_LOGS")
        if not logs:
            return subprocess.DEVNULL
        Path(logs).mkdir(parents=True, exist_ok=True)
        return open(Path(logs) / f"{name}-{self.worker_id}.log", "ab")

    def stop(self, name: str) -> None:
        p = self.procs.pop(name)
        p.terminate()
        p.wait()

    def start_worker(self, **env: str) -> None:
        """A worker, which registers at the API and is not told where the database is."""
        self._worker("worker", self.worker_id, env)

    def _worker(self, name: str, worker_id: str, env: dict[str, str]) -> None:
        argv = ["worker", "--id", worker_id, "--port", str(free_port())]
        own = {k: v for k, v in self.env.items() if k != "SPACE_DATABASE_URL"}
        self.procs[name] = subprocess.Popen(
            [*SPACE, *argv], env={**own, "SPACE_CONTROL_URL": self.url, **env},
            stderr=self._log(name),
        )  # fmt: skip

    def add_host(self, **env: str) -> str:
        """Another worker, with a pool of its own; its id (its process is `procs[id]`)."""
        worker_id = f"{self.worker_id}-h{len(self.hosts) + 1}"
        self.hosts.append(worker_id)
        self._worker(worker_id, worker_id, {"SPACE_POOL_DIR": str(HOSTS / worker_id), **env})
        return worker_id

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"},
                            timeout=300)  # fmt: skip

    def wait_worker(self, key: str) -> None:
        """Until a create succeeds (the worker registered and answers)."""
        with self.client(key) as c:
            while True:
                r = c.post("/v1/sandboxes", json={"memory_mib": 128})
                if r.status_code in (200, 201) and r.json()["state"] == "running":
                    c.delete(f"/v1/sandboxes/{r.json()['id']}")
                    return
                time.sleep(0.5)


# For benches that are no test of quotas or the rate limit: a hundred sandboxes and more for one
# tenant, and polls and execs as fast as they go. Set in os.environ: the services inherit it.
UNLIMITED = {"SPACE_QUOTA_SANDBOXES": "10000", "SPACE_QUOTA_VCPUS": "10000",
             "SPACE_QUOTA_MEMORY_MIB": "100000000", "SPACE_QUOTA_DISK_MIB": "1000000000",
             "SPACE_RATE_LIMIT": "100000", "SPACE_RATE_BURST": "100000"}  # fmt: skip


@contextmanager
def platform(
    setup: Callable[[Store], Awaitable[dict[str, str]]], **worker_env: str
) -> Iterator[tuple[BenchPlatform, dict[str, str]]]:
    """A running platform and what `setup(store)` made in its fresh database (e.g. keys)."""
    tmp = Path(tempfile.mkdtemp(prefix="space-bench-"))
    db = embedded.start(tmp / "pg")

    async def prepare() -> dict[str, str]:
        store = Store(connect(db))
        try:
            await migrate.upgrade(store.engine)
            await store.ensure_template("base")
            return await setup(store)
        finally:
            await store.close()

    made = asyncio.run(prepare())
    port = free_port()
    env = {**os.environ, "SPACE_DATABASE_URL": db, "SPACE_WORKER_SECRET": secrets.token_hex(16)}
    p = BenchPlatform(f"http://127.0.0.1:{port}", db, env, f"bench{secrets.token_hex(2)}")
    try:
        p.start_worker(**worker_env)
        p.start("controller", "controller")
        p.start("api", "api", "--port", str(port))
        while True:
            try:
                if httpx.get(f"{p.url}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield p, made
    finally:
        for name in list(p.procs):
            p.stop(name)
        embedded.stop(tmp / "pg")
        shutil.rmtree(tmp, ignore_errors=True)
        # The bench worker's VMs were left running for a next worker process to adopt: stop
        # them, and drop its disks and base snapshots; hosts lose their whole pool.
        pool = asyncio.run(local_runtime()).pool
        for worker_id, root in [(p.worker_id, pool.root), *((h, HOSTS / h) for h in p.hosts)]:
            leftover = root / "workers" / worker_id
            subprocess.run(["pkill", "-9", "-f", f"{leftover}/"], check=False)
            asyncio.run(netsetup.remove_networks(worker_id, leftover, Path("/var/lib/space")))
            shutil.rmtree(leftover if root == pool.root else root, ignore_errors=True)

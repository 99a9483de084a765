"""The whole platform, for real: embedded PostgreSQL, API, controller and workers as processes.

Each service runs as its own `space` process so tests can `kill -9` any of them. The database is
a throwaway embedded server; workers get ids of their own, so their VMs and disks never mix with
another deployment's on the same host.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from space.db import embedded, migrate
from space.db.store import Store, connect
from space.worker import netsetup

from ..network.world import DNS_IP, World, cleanup
from ..vm.conftest import vmm_pids

pytestmark = pytest.mark.vm

SPACE = [sys.executable, "-m", "space.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    """One platform process that a test can kill and start again."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*SPACE, *self.argv], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill9()

    def restart(self) -> None:
        self.stop()
        self.start()


@dataclass
class Platform:
    api_url: str
    database_url: str
    key_a: str
    key_b: str
    admin_key: str
    controller_metrics: str
    internet: World
    api: Service
    controller: Service
    workers: dict[str, Service] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    tmp: Path = Path()

    def add_worker(self, worker_id: str) -> Service:
        port = free_port()
        svc = Service(
            f"worker-{worker_id}",
            ["worker", "--id", worker_id, "--port", str(port)],
            self.env,
            self.tmp / f"worker-{worker_id}.log",
        )
        svc.start()
        self.workers[worker_id] = svc
        return svc

    def client(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.api_url,
            headers={"Authorization": f"Bearer {key or self.key_a}"},
            timeout=300,
        )

    def wait_api(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.api_url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"API did not come up; see {self.api.log}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )


async def _bootstrap(url: str) -> tuple[str, str, str]:
    """Keys of tenants A and B, and an admin key of a third tenant."""
    store = Store(connect(url))
    try:
        await migrate.upgrade(store.engine)
        await store.ensure_template("base")
        a = await store.create_tenant(f"a-{secrets.token_hex(4)}")
        b = await store.create_tenant(f"b-{secrets.token_hex(4)}")
        ops = await store.create_tenant(f"ops-{secrets.token_hex(4)}")
        return (
            await store.create_api_key(a.id),
            await store.create_api_key(b.id),
            await store.create_api_key(ops.id, admin=True),
        )
    finally:
        await store.close()


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    if os.geteuid() != 0:
        pytest.fail("the platform tests need root")
    tmp = tmp_path_factory.mktemp("platform")
    # A small "internet" of namespaces (DNS, HTTP and HTTPS origins) for the gateways.
    internet = World(tmp / "internet")
    cleanup()
    internet.directory.mkdir()
    internet._internet()
    assert internet.origin_ca is not None
    pgdata = tmp / "pg"
    url = embedded.start(pgdata)
    key_a, key_b, admin_key = asyncio.run(_bootstrap(url))
    port = free_port()
    metrics = f"127.0.0.1:{free_port()}"
    env = {
        **os.environ,
        "SPACE_DATABASE_URL": url,
        "SPACE_WORKER_SECRET": secrets.token_urlsafe(24),
        "SPACE_WORKER_DEAD_AFTER": "3",
        "SPACE_WORKER_VCPUS": "64",
        "SPACE_WORKER_MEMORY_MIB": "16384",
        "SPACE_CONTROLLER_METRICS": metrics,
        "SPACE_GATEWAY_UPSTREAM_DNS": DNS_IP,
        "SPACE_GATEWAY_UPSTREAM_CA": str(internet.origin_ca),
    }
    p = Platform(
        api_url=f"http://127.0.0.1:{port}",
        database_url=url,
        key_a=key_a,
        key_b=key_b,
        admin_key=admin_key,
        controller_metrics=f"http://{metrics}/metrics",
        internet=internet,
        api=Service("api", ["api", "--port", str(port)], env, tmp / "api.log"),
        controller=Service("controller", ["controller"], env, tmp / "controller.log"),
        env=env,
        tmp=tmp,
    )
    worker_id = f"t{secrets.token_hex(3)}"
    p.add_worker(worker_id)
    p.controller.start()
    p.api.start()
    try:
        p.wait_api()
        yield p
    finally:
        # Delete what the tests left, so their VMs and disks go too.
        try:
            with p.client() as c:
                for key in (p.key_a, p.key_b):
                    c.headers["Authorization"] = f"Bearer {key}"
                    for sb in c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]:
                        if sb["state"] != "deleted":
                            c.delete(f"/v1/sandboxes/{sb['id']}")
        except httpx.HTTPError:
            pass
        for svc in (p.api, p.controller, *p.workers.values()):
            svc.stop()
        # Whatever a failed test left behind: these workers' VMs, disks and snapshots.
        pool = Path("/var/lib/space/pool/workers")
        for wid in p.workers:
            for pid in vmm_pids(pool / wid):
                os.kill(pid, signal.SIGKILL)
            asyncio.run(netsetup.remove_networks(wid, pool / wid))
            shutil.rmtree(pool / wid, ignore_errors=True)
        embedded.stop(pgdata)
        shutil.rmtree(pgdata, ignore_errors=True)
        asyncio.run(internet.stop())

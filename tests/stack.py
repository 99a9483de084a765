"""The whole platform, for real: embedded PostgreSQL, API, controller and workers as processes.

Each service runs as its own `space` process so tests can `kill -9` any of them. The database is
a throwaway embedded server; workers get ids of their own, so their VMs and disks never mix with
another deployment's on the same host. With `tls`, the control plane and its workers speak
mutual TLS: each worker joins with a one-time token for its certificate of the stack's worker CA.

With a `registry`, the platform is many hosts on one machine: each worker runs in a network
namespace of its own (reaching the API and the registry only over its veth, at CONTROL_IP) with
a pool directory of its own, so nothing on disk or on the network is shared between hosts.
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
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from space.db import embedded, migrate
from space.db import tables as t
from space.db.store import Store, connect
from space.pki import make_ca
from space.worker import netsetup
from space.worker.storage.pool import ensure_pool

from .network.world import DNS_IP, World, cleanup
from .vm.conftest import vmm_pids

SPACE = [sys.executable, "-m", "space.cli.main"]
POOL = Path("/var/lib/space/pool/workers")
HOSTS = Path("/var/lib/space/pool/hosts")  # a pool of its own per worker: one host each
# The control plane's address as hosts in namespaces reach it (on this machine's loopback), and
# host i's link: 10.211.i.1 outside, 10.211.i.2 in its namespace `sph-<worker id>`.
CONTROL_IP = "10.211.0.1"
HOST_NET = "10.211"
HOST_NS = "sph-"
CONTROL_PLANE_ONLY = ("SPACE_WORKER_CA_DIR", "SPACE_DATABASE_URL")


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
    prefix: list[str] = field(default_factory=list)  # e.g. nsenter into a host's namespace

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [*self.prefix, *SPACE, *self.argv], env=self.env, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

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
    metrics_token: str
    internet: World
    api: Service
    controller: Service
    workers: dict[str, Service] = field(default_factory=dict)
    worker_metrics: dict[str, str] = field(default_factory=dict)  # worker id: metrics URL
    env: dict[str, str] = field(default_factory=dict)
    tmp: Path = Path()
    own_pools: bool = False  # each worker a host of its own: nothing on disk is shared
    hosts: dict[str, int] = field(default_factory=dict)  # worker id: its host's number

    def pool_of(self, worker_id: str) -> Path:
        """The pool the worker's templates, snapshots and volumes are in."""
        return HOSTS / worker_id if self.own_pools else POOL.parent

    def root_of(self, worker_id: str) -> Path:
        """The worker's own directory: its VMs, their disks and snapshots."""
        return self.pool_of(worker_id) / "workers" / worker_id

    def add_worker(self, worker_id: str, **env: str) -> Service:
        """A worker; under mutual TLS it joins with a token of its own (`env` may say
        otherwise)."""
        port = free_port()
        metrics = f"127.0.0.1:{free_port()}"
        # The worker CA's key and the database stay with the control plane: a worker registers
        # at the API.
        own = {k: v for k, v in self.env.items() if k not in CONTROL_PLANE_ONLY}
        own.update(SPACE_WORKER_METRICS=metrics, SPACE_CONTROL_URL=self.api_url)
        if self.own_pools:
            own["SPACE_POOL_DIR"] = str(self.pool_of(worker_id))
        if "SPACE_WORKER_CA_DIR" in self.env:
            token = self.tmp / f"join-{worker_id}"
            token.write_text(asyncio.run(_join_token(self.database_url, worker_id)))
            own.update(SPACE_WORKER_TLS="1", SPACE_WORKER_JOIN_TOKEN_FILE=str(token))
        argv, prefix = ["worker", "--id", worker_id, "--port", str(port)], []
        if self.own_pools:
            address = add_host(self.hosts, worker_id)
            scheme = "https" if "SPACE_WORKER_TLS" in own else "http"
            argv += ["--host", address, "--url", f"{scheme}://{address}:{port}"]
            prefix = ["nsenter", f"--net=/run/netns/{HOST_NS}{worker_id}"]
        svc = Service(f"worker-{worker_id}", argv, {**own, **env},
                      self.tmp / f"worker-{worker_id}.log", prefix=prefix)  # fmt: skip
        self.worker_metrics[worker_id] = f"http://{metrics}/metrics"
        svc.start()
        self.workers[worker_id] = svc
        return svc

    def remove_worker(self, worker_id: str) -> None:
        """Stop a worker and take away whatever it left: its VMs, disks, snapshots, networks."""
        self.workers.pop(worker_id).stop()
        root = self.root_of(worker_id)
        for pid in vmm_pids(root):
            os.kill(pid, signal.SIGKILL)
        if worker_id in self.hosts:
            remove_host(worker_id, root)
        else:
            asyncio.run(netsetup.remove_networks(worker_id, root, Path("/var/lib/space")))
        shutil.rmtree(self.pool_of(worker_id) if self.own_pools else root, ignore_errors=True)

    @property
    def worker_id(self) -> str:
        """The platform's first worker."""
        return next(iter(self.workers))

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

    def wait_worker(self, timeout: float = 120) -> None:
        """Until a worker has registered and can take sandboxes."""

        async def ready() -> int:
            store = Store(connect(self.database_url, pool_size=1))
            try:
                return await store.ready_workers()
            finally:
                await store.close()

        deadline = time.monotonic() + timeout
        while asyncio.run(ready()) == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker registered; see {self.tmp}")
            time.sleep(0.2)

    def rows(self, ids: Iterable[str]) -> list[dict[str, object]]:
        """The database's rows of these sandboxes (state, desired state, pool, tenant, reason):
        what a failure needs to say about VMs it finds."""

        async def read() -> list[dict[str, object]]:
            store = Store(connect(self.database_url, pool_size=1))
            try:
                async with store.engine.connect() as c:
                    s = t.sandboxes.c
                    q = sa.select(s.id, s.state, s.desired_state, s.pool, s.tenant_id, s.reason,
                                  s.updated_at).where(s.id.in_(list(ids)))  # fmt: skip
                    return [dict(r) for r in (await c.execute(q)).mappings()]
            finally:
                await store.close()

        return asyncio.run(read())

    def scalar(self, sql: str, **params: object) -> object:
        """One value the database answers (what a test checks where only the database says)."""

        async def read() -> object:
            store = Store(connect(self.database_url, pool_size=1))
            try:
                async with store.engine.connect() as c:
                    return await c.scalar(sa.text(sql), params)
            finally:
                await store.close()

        return asyncio.run(read())

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )


def control_address() -> str:
    """CONTROL_IP on this machine's loopback, where hosts in namespaces reach the control plane
    and the registry."""
    subprocess.run(["ip", "addr", "replace", f"{CONTROL_IP}/32", "dev", "lo"], check=True)
    return CONTROL_IP


def add_host(hosts: dict[str, int], worker_id: str) -> str:
    """A network namespace for the worker, linked to this machine alone; its address there."""
    i = hosts[worker_id] = max(hosts.values(), default=0) + 1
    ns, outside, inside = f"{HOST_NS}{worker_id}", f"sph{i}o", f"sph{i}i"
    for argv in (
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns],
        ["ip", "addr", "add", f"{HOST_NET}.{i}.1/30", "dev", outside],
        ["ip", "link", "set", outside, "up"],
        ["ip", "-n", ns, "addr", "add", f"{HOST_NET}.{i}.2/30", "dev", inside],
        ["ip", "-n", ns, "link", "set", inside, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "-n", ns, "route", "add", f"{CONTROL_IP}/32", "via", f"{HOST_NET}.{i}.1"],
    ):
        subprocess.run(argv, check=True, capture_output=True)
    return f"{HOST_NET}.{i}.2"


def remove_host(worker_id: str, root: Path) -> None:
    """The worker's networks (made inside its namespace), then the namespace and its link."""
    ns = f"{HOST_NS}{worker_id}"
    if Path(f"/run/netns/{ns}").exists():
        code = ("import asyncio, pathlib, sys; from space.worker import netsetup; "
                "asyncio.run(netsetup.remove_networks(sys.argv[1], pathlib.Path(sys.argv[2]), "
                "pathlib.Path('/var/lib/space')))")  # fmt: skip
        subprocess.run(["nsenter", f"--net=/run/netns/{ns}", sys.executable, "-c", code,
                        worker_id, str(root)], check=False)  # fmt: skip
        subprocess.run(["ip", "netns", "del", ns], check=False)


def remove_hosts() -> None:
    """Every host namespace a run left, and the control plane's address."""
    for ns in Path("/run/netns").glob(f"{HOST_NS}*") if Path("/run/netns").is_dir() else []:
        worker_id = ns.name.removeprefix(HOST_NS)
        remove_host(worker_id, HOSTS / worker_id / "workers" / worker_id)
    subprocess.run(["ip", "addr", "del", f"{CONTROL_IP}/32", "dev", "lo"], check=False,
                   capture_output=True)  # fmt: skip


async def _join_token(url: str, worker_id: str) -> str:
    store = Store(connect(url, pool_size=1))
    try:
        return await store.create_join_token(worker_id, timedelta(minutes=10))
    finally:
        await store.close()


async def _bootstrap(url: str, migrated: bool = False) -> tuple[str, str, str]:
    """Keys of tenants A and B, and an admin key of a third tenant; the schema first, unless
    another release already `migrated` it."""
    store = Store(connect(url))
    try:
        if not migrated:
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


def release_env(env: dict[str, str], release: Path | None) -> dict[str, str]:
    """`env` for a service of the release whose package is in `release` (a `src` directory of
    another checkout), or of this checkout's for None."""
    own = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    return {**own, "PYTHONPATH": str(release)} if release is not None else own


def launch(
    tmp: Path, tls: bool = False, registry: str = "", release: Path | None = None, **settings: str
) -> Platform:
    """A whole platform of real processes, with a local internet for its gateways. With a
    `registry` (host:port of a plain-HTTP one), templates, snapshots and volumes go there, and
    every worker is a host of its own, with its own pool. With a `release` (the `src` directory
    of another checkout), every service and the schema are that release's. `settings`:
    environment variables of every service, over the defaults."""
    if os.geteuid() != 0:
        pytest.fail("the platform tests need root")
    # A small "internet" of namespaces (DNS, HTTP and HTTPS origins) for the gateways.
    internet = World(tmp / "internet")
    cleanup()
    internet.directory.mkdir()
    internet._internet()
    assert internet.origin_ca is not None
    pgdata = tmp / "pg"
    url = embedded.start(pgdata)
    port = free_port()
    metrics = f"127.0.0.1:{free_port()}"
    metrics_token = secrets.token_urlsafe(16)
    env = {
        **os.environ,
        "SPACE_DATABASE_URL": url,
        "SPACE_WORKER_SECRET": secrets.token_urlsafe(24),
        "SPACE_WORKER_LOST_AFTER": "3",
        "SPACE_LEASE_TTL": "6",
        "SPACE_CLAIM_GRACE": "4",
        "SPACE_WORKER_VCPUS": "64",
        "SPACE_WORKER_MEMORY_MIB": "16384",
        # Tenants A and B hold many sandboxes over a session; quotas get a tenant of their own.
        "SPACE_QUOTA_SANDBOXES": "1000",
        "SPACE_QUOTA_VCPUS": "1000",
        "SPACE_QUOTA_MEMORY_MIB": "1000000",
        "SPACE_QUOTA_DISK_MIB": "100000000",
        "SPACE_CONTROLLER_METRICS": metrics,
        "SPACE_METRICS_TOKEN": metrics_token,
        "SPACE_USAGE_RESOLUTION": "1",  # metering reads every second (test_usage)
        "SPACE_GATEWAY_UPSTREAM_DNS": DNS_IP,
        "SPACE_GATEWAY_UPSTREAM_CA": str(internet.origin_ca),
        # A line per request and per step, each naming its request (tests/platform/test_logs).
        "SPACE_LOG_FORMAT": "json",
        "SPACE_LOG_LEVEL": "info",
        **settings,
    }
    if release is not None:
        env = release_env(env, release)
        subprocess.run([*SPACE, "admin", "migrate"], env=env, check=True, capture_output=True)
    key_a, key_b, admin_key = asyncio.run(_bootstrap(url, migrated=release is not None))
    api_host = "127.0.0.1"
    if registry:
        env.update(SPACE_REGISTRY=f"{registry}/space", SPACE_REGISTRY_INSECURE="1")
        ensure_pool()  # the hosts' pools are directories of it: reflinks, as on a real host
        api_host = env["SPACE_API_HOST"] = control_address()
        # One deployment CA for every gateway, as on Kubernetes: base snapshots have it inside.
        env["SPACE_GATEWAY_CA_DIR"] = str(tmp / "gateway-ca")
        make_ca(tmp / "gateway-ca" / "ca.pem", tmp / "gateway-ca" / "ca.key", "SPACE test CA")
    if tls:
        env["SPACE_WORKER_CA_DIR"] = str(tmp / "worker-ca")
        make_ca(tmp / "worker-ca" / "ca.pem", tmp / "worker-ca" / "ca.key", "SPACE worker CA")
    p = Platform(
        api_url=f"http://{api_host}:{port}",
        database_url=url,
        key_a=key_a,
        key_b=key_b,
        admin_key=admin_key,
        controller_metrics=f"http://{metrics}/metrics",
        metrics_token=metrics_token,
        internet=internet,
        api=Service("api", ["api", "--port", str(port)], env, tmp / "api.log"),
        controller=Service("controller", ["controller"], env, tmp / "controller.log"),
        env=env,
        tmp=tmp,
        own_pools=bool(registry),
    )
    p.controller.start()
    p.api.start()
    p.wait_api()
    p.add_worker(f"t{secrets.token_hex(3)}")  # under TLS it joins through the API
    p.wait_worker()
    return p


def shut_down(p: Platform) -> None:
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
    for svc in (p.api, p.controller):
        svc.stop()
    for wid in list(p.workers):
        p.remove_worker(wid)
    if p.own_pools:
        remove_hosts()
    pgdata = p.tmp / "pg"
    embedded.stop(pgdata)
    shutil.rmtree(pgdata, ignore_errors=True)
    asyncio.run(p.internet.stop())

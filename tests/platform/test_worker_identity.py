"""Worker identity on a whole platform of its own in mutual TLS (`space.identity`): its worker
joined with a one-time token and serves sandboxes over it, and holds no database credentials (it
registered at the API); a worker process with no certificate and no token does not start, one
showing another worker's certificate is never registered, and a host with a worker's stolen key
and the worker secret cannot take that worker's place while it lives."""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from space.db import tables as t
from space.db.store import Store, connect

from ..platform.helpers import create, run
from ..stack import POOL, Platform, free_port, launch, shut_down

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def tls_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """Not the session's platform: launched and shut down before it (see tests/conftest.py)."""
    p = launch(tmp_path_factory.mktemp("tls-platform"), tls=True)
    try:
        yield p
    finally:
        shut_down(p)


async def _worker_rows(url: str) -> dict[str, str]:
    store = Store(connect(url, pool_size=1))
    try:
        async with store.engine.connect() as c:
            rows = await c.execute(sa.select(t.workers.c.id, t.workers.c.state))
            return {r.id: r.state for r in rows}
    finally:
        await store.close()


def test_the_platforms_worker_serves_with_the_certificate_it_joined_for(
    tls_platform: Platform,
) -> None:
    with tls_platform.client() as c:  # the controller makes it, the API streams the exec
        sid = create(c)["id"]
        assert run(c, sid, "echo over mutual TLS")[0] == b"over mutual TLS\n"
        c.delete(f"/v1/sandboxes/{sid}")
    identity = POOL / tls_platform.worker_id / "identity"
    assert {p.name for p in identity.iterdir()} == {"cert.pem", "key.pem", "ca.pem"}
    assert (identity / "key.pem").stat().st_mode & 0o077 == 0
    assert (identity / "ca.pem").read_bytes() == (
        tls_platform.tmp / "worker-ca" / "ca.pem"
    ).read_bytes()
    assert "SPACE_WORKER_CA_DIR" not in tls_platform.workers[tls_platform.worker_id].env


def test_a_worker_without_a_certificate_or_a_token_does_not_start(tls_platform: Platform) -> None:
    worker_id = f"t{secrets.token_hex(3)}"
    svc = tls_platform.add_worker(
        worker_id, SPACE_WORKER_JOIN_TOKEN_FILE=str(tls_platform.tmp / "none")
    )
    try:
        assert svc.proc is not None
        assert svc.proc.wait(120) != 0
        assert "has no certificate yet" in svc.log.read_text()
        assert worker_id not in asyncio.run(_worker_rows(tls_platform.database_url))
    finally:
        tls_platform.remove_worker(worker_id)


def test_a_worker_showing_another_workers_certificate_is_never_registered(
    tls_platform: Platform,
) -> None:
    """A host that took the first worker's certificate and key registers as a worker of its
    own: the API's call back to it fails the name check, so it is never a worker."""
    worker_id = f"t{secrets.token_hex(3)}"
    shutil.copytree(POOL / tls_platform.worker_id / "identity", POOL / worker_id / "identity")
    svc = tls_platform.add_worker(worker_id)
    try:
        deadline = time.monotonic() + 60
        while "not registered yet (502" not in svc.log.read_text():
            assert time.monotonic() < deadline, svc.log.read_text()
            time.sleep(0.5)
        assert "Hostname mismatch" in svc.log.read_text()
        assert svc.proc is not None and svc.proc.poll() is None  # it keeps trying, in vain
        assert worker_id not in asyncio.run(_worker_rows(tls_platform.database_url))
        assert (
            asyncio.run(_worker_rows(tls_platform.database_url))[tls_platform.worker_id] == "active"
        )
    finally:
        tls_platform.remove_worker(worker_id)


@contextmanager
def impostor(identity: Path, worker_id: str) -> Iterator[tuple[str, str]]:
    """A server with a worker's stolen certificate and key that answers the API's call back as
    that worker would: its URL and the instance it claims."""
    instance = secrets.token_hex(8)
    health = json.dumps({"worker_id": worker_id, "instance": instance,
                         "capacity": {"vcpus": 64, "memory_mib": 65536},
                         "used": {"vcpus": 0, "memory_mib": 0}}).encode()  # fmt: skip

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(health)))
            self.end_headers()
            self.wfile.write(health)

        def log_message(self, *_: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Answer)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(identity / "cert.pem", identity / "key.pem")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}", instance
    finally:
        server.shutdown()
        server.server_close()


def test_registration_asks_for_the_worker_secret_and_a_worker_that_answers_as_itself(
    tls_platform: Platform,
) -> None:
    p, wid = tls_platform, tls_platform.worker_id
    secret = p.env["SPACE_WORKER_SECRET"]
    register = f"{p.api_url}/v1/workers/{wid}/register"
    before = asyncio.run(_worker_row(p.database_url, wid))
    with impostor(POOL / wid / "identity", wid) as (url, instance):
        body = {"url": url, "instance": instance}
        # Without the worker secret, or with a tenant's API key: nothing is called back.
        for auth in (None, f"Bearer {p.key_a}", f"Bearer {p.admin_key}"):
            headers = {"Authorization": auth} if auth else {}
            r = httpx.post(register, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, r.text
        auth = {"Authorization": f"Bearer {secret}"}
        # With both, the stolen key still cannot take the place of the worker while it lives.
        r = httpx.post(register, json=body, headers=auth, timeout=30)
        assert r.status_code == 409 and "is alive at" in r.json()["detail"], r.text
        # Nor can anything be registered where no worker of that id answers.
        dead = {"url": f"https://127.0.0.1:{free_port()}", "instance": instance}
        r = httpx.post(f"{p.api_url}/v1/workers/tnew{secrets.token_hex(2)}/register",
                       json=dead, headers=auth, timeout=30)  # fmt: skip
        assert r.status_code == 502, r.text
        for bad in ({"url": "file:///etc/passwd", "instance": instance},
                    {"url": url, "instance": "not hex"}):  # fmt: skip
            r = httpx.post(register, json=bad, headers=auth, timeout=30)
            assert r.status_code == 422, r.text
        # A heartbeat for another instance than the registered one is told so.
        r = httpx.post(f"{p.api_url}/v1/workers/{wid}/heartbeat", json={"instance": instance},
                       headers=auth, timeout=30)  # fmt: skip
        assert r.status_code == 409, r.text
    assert asyncio.run(_worker_row(p.database_url, wid)) == before
    with p.client() as c:  # and the worker still serves
        sid = create(c)["id"]
        assert run(c, sid, "echo still")[0] == b"still\n"
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_worker_process_holds_no_database_credentials(tls_platform: Platform) -> None:
    """Nothing of the database's is in the worker's environment or command line, and it holds
    no connection to it; the API, beside it, does (the check can see one)."""
    p = tls_platform
    worker = p.workers[p.worker_id]
    pgdata = str(p.tmp / "pg")
    assert "postgresql" in p.database_url and pgdata in p.database_url
    for pid in [worker.pid, *children(worker.pid)]:
        seen = Path(f"/proc/{pid}/environ").read_bytes() + Path(f"/proc/{pid}/cmdline").read_bytes()
        for word in ("SPACE_DATABASE_URL", "postgresql", pgdata):
            assert word.encode() not in seen, (pid, word)
    assert database_connections(p.api.pid) > 0
    assert database_connections(worker.pid) == 0


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in found.split()]


def database_connections(pid: int) -> int:
    """Unix-socket connections the process holds to a PostgreSQL socket (`ss` pairs each end
    with its peer's inode)."""
    lines = subprocess.run(["ss", "-xpnH"], capture_output=True, text=True, check=True).stdout
    server_ends, mine = set(), []
    for line in lines.splitlines():
        cols = line.split()
        if len(cols) < 8:
            continue
        local, local_inode, peer_inode = cols[4], cols[5], cols[7]
        if ".s.PGSQL." in local:
            server_ends.add(local_inode)
        if f"pid={pid}," in line:
            mine.append(peer_inode)
    return sum(1 for peer in mine if peer in server_ends)


async def _worker_row(url: str, worker_id: str) -> tuple[str, str]:
    store = Store(connect(url, pool_size=1))
    try:
        row = await store.worker(worker_id)
        assert row is not None
        return row["url"], row["instance"]
    finally:
        await store.close()

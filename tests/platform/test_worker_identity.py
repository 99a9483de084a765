"""Worker identity on a whole platform of its own in mutual TLS (`space.identity`): its worker
joined with a one-time token and serves sandboxes over it; a worker process with no certificate
and no token does not start, and one showing another worker's certificate is never reached, so
it is lost and takes no sandbox."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from space.db import tables as t
from space.db.store import Store, connect

from ..platform.helpers import create, run
from ..stack import POOL, Platform, launch, shut_down

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


def test_a_worker_showing_another_workers_certificate_is_lost_and_takes_nothing(
    tls_platform: Platform,
) -> None:
    """A host that took the first worker's certificate and key registers as a worker of its
    own: the control plane never completes a call to it."""
    worker_id = f"t{secrets.token_hex(3)}"
    shutil.copytree(POOL / tls_platform.worker_id / "identity", POOL / worker_id / "identity")
    svc = tls_platform.add_worker(worker_id)
    try:
        deadline = time.monotonic() + 60
        while asyncio.run(_worker_rows(tls_platform.database_url)).get(worker_id) != "lost":
            assert time.monotonic() < deadline, "the impostor was never declared lost"
            assert svc.proc is not None and svc.proc.poll() is None, svc.log.read_text()
            time.sleep(0.5)
        assert "Hostname mismatch" in tls_platform.controller.log.read_text()
        with tls_platform.client() as c:
            placed = {
                sb.get("worker_id")
                for sb in c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]
            }
        assert worker_id not in placed
        assert (
            asyncio.run(_worker_rows(tls_platform.database_url))[tls_platform.worker_id] == "active"
        )
    finally:
        tls_platform.remove_worker(worker_id)

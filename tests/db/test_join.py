"""A worker joins: the one-time token `space admin join-token` prints, traded at the real API
(on a real PostgreSQL) for a certificate of the worker CA that names that worker."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import uvicorn
from cryptography import x509

from space.api.app import create_app
from space.db.store import Store, connect
from space.identity import IdentityError, WorkerIdentity, worker_name
from space.pki import make_ca
from space.settings import APISettings, Settings, new_sealing_key
from tests.cli.runner import space


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(settings: Settings, database: str) -> AsyncIterator[str]:
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings, database), host="127.0.0.1", port=port,
                       log_level="warning", log_config=None)
    )  # fmt: skip
    task = asyncio.ensure_future(server.serve())
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(timeout=2) as http:
        for _ in range(200):
            try:
                if (await http.get(f"{url}/healthz")).status_code == 200:
                    break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        await task


def _settings(tmp: Path, worker_ca: Path | None) -> Settings:
    return Settings(state_dir=tmp, worker_ca_dir=worker_ca, worker_secret="s",
                    secrets_keys=new_sealing_key(), api=APISettings(metrics_token="m"))  # fmt: skip


@pytest.fixture(scope="module")
async def api(database: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    tmp = tmp_path_factory.mktemp("join")
    make_ca(tmp / "ca" / "ca.pem", tmp / "ca" / "ca.key", "SPACE worker CA")
    async for url in _serve(_settings(tmp, tmp / "ca"), database):
        yield url


@pytest.fixture(scope="module")
async def store(database: str) -> AsyncIterator[Store]:
    s = Store(connect(database, pool_size=1))
    yield s
    await s.close()


async def test_a_worker_joins_once_with_the_token_made_for_it(
    api: str, database: str, tmp_path: Path
) -> None:
    run = await asyncio.to_thread(
        space, "admin", "join-token", "node-1.example", env={"SPACE_DATABASE_URL": database}
    )
    token = run.stdout.strip()
    identity = WorkerIdentity(tmp_path / "node-1", "node-1.example")
    files = await identity.join(api, token)
    cert = x509.load_pem_x509_certificate(files.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [worker_name("node-1.example")]
    assert files.key.stat().st_mode & 0o077 == 0
    # Spent: the same token again (a copy taken on the way) gets nothing.
    again = WorkerIdentity(tmp_path / "thief", "node-1.example")
    with pytest.raises(IdentityError, match="403"):
        await again.join(api, token)
    assert not again.present()


async def test_a_token_is_only_for_its_worker_and_its_time(
    api: str, store: Store, tmp_path: Path
) -> None:
    token = await store.create_join_token("node-2", timedelta(minutes=5))
    with pytest.raises(IdentityError, match="403"):
        await WorkerIdentity(tmp_path / "other", "node-3").join(api, token)
    # A refusal for another worker does not spend it, nor does a request that is not one.
    async with httpx.AsyncClient() as http:
        bad = await http.post(f"{api}/v1/workers/node-2/join", json={"token": token, "csr": "no"})
    assert bad.status_code == 400
    assert (await WorkerIdentity(tmp_path / "node-2", "node-2").join(api, token)).cert.exists()
    expired = await store.create_join_token("node-4", timedelta(seconds=-1))
    with pytest.raises(IdentityError, match="403"):
        await WorkerIdentity(tmp_path / "node-4", "node-4").join(api, expired)


async def test_an_id_that_is_no_dns_name_is_refused(api: str, tmp_path: Path) -> None:
    async with httpx.AsyncClient() as http:
        resp = await http.post(f"{api}/v1/workers/Bad_Id/join", json={"token": "t", "csr": "c"})
    assert resp.status_code == 422


async def test_without_a_worker_ca_no_one_joins(
    database: str, store: Store, tmp_path: Path
) -> None:
    token = await store.create_join_token("node-5", timedelta(minutes=5))
    async for url in _serve(_settings(tmp_path, None), database):
        with pytest.raises(IdentityError, match="404"):
            await WorkerIdentity(tmp_path / "node-5", "node-5").join(url, token)

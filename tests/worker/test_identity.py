"""Mutual TLS between the control plane and a worker (`space.identity`), on a real worker
server: the control plane reaches the worker it means to; a host showing another worker's
certificate, a caller with no certificate, one with a worker's certificate or one from another
CA are all refused."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from space.identity import WorkerCA, WorkerIdentity, worker_name
from space.pki import make_ca
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.server import serve
from space.worker.local import LocalRuntime
from tests.worker.harness import free_port, manager

pytestmark = pytest.mark.vm  # needs this host's pool (no VM is booted)

SECRET = "identity-" + uuid.uuid4().hex


def make_worker_ca(directory: Path) -> WorkerCA:
    make_ca(directory / "ca.pem", directory / "ca.key", "SPACE worker CA")
    return WorkerCA(directory)


def issued(ca: WorkerCA, directory: Path, worker_id: str) -> WorkerIdentity:
    identity = WorkerIdentity(directory, worker_id)
    identity.accept(ca.issue(worker_id, identity.request()), ca.ca_pem)
    return identity


@dataclass
class World:
    ca: WorkerCA
    a: WorkerIdentity  # the worker that serves
    b: WorkerIdentity  # another worker of the same deployment
    url: str
    client: WorkerClient

    def raw(self, ctx: ssl.SSLContext) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=ctx, timeout=5, headers={"Authorization": f"Bearer {SECRET}"}
        )


@pytest.fixture(scope="module")
async def world(
    runtime: LocalRuntime, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[World]:
    tmp = tmp_path_factory.mktemp("identity")
    ca = make_worker_ca(tmp / "ca")
    a_id, b_id = f"wa-{uuid.uuid4().hex[:8]}", f"wb-{uuid.uuid4().hex[:8]}"
    a, b = issued(ca, tmp / "a", a_id), issued(ca, tmp / "b", b_id)
    vms = manager(runtime, a_id)
    await vms.start()
    port = free_port()
    server = asyncio.ensure_future(serve(vms, SECRET, "127.0.0.1", port, tls=a.files))
    client = WorkerClient(SECRET, tls=ca.client_context())
    w = World(ca, a, b, f"https://127.0.0.1:{port}", client)
    try:
        for _ in range(200):
            try:
                await client.health(Worker(a_id, w.url))
                break
            except WorkerError:
                await asyncio.sleep(0.05)
        yield w
    finally:
        await client.close()
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        await vms.close(stop_vms=True)
        shutil.rmtree(vms.root, ignore_errors=True)


async def test_the_control_plane_reaches_the_worker_it_means(world: World) -> None:
    health = await world.client.health(Worker(world.a.worker_id, world.url))
    assert health.worker_id == world.a.worker_id


async def test_a_host_showing_another_workers_certificate_is_refused(world: World) -> None:
    """What a caller sees when the host registered as B presents A's (stolen) certificate."""
    with pytest.raises(WorkerError) as refused:
        await world.client.health(Worker(world.b.worker_id, world.url))
    assert refused.value.status == 0 and "certificate" in refused.value.detail.lower()


async def test_a_data_plane_websocket_checks_the_worker_too(world: World) -> None:
    # Through TLS to the right worker, the WebSocket opens (the worker then finds no such VM).
    async with world.client.exec_ws(Worker(world.a.worker_id, world.url), "nope"):
        pass
    with pytest.raises(httpx.ConnectError, match="Hostname mismatch"):
        async with world.client.exec_ws(Worker(world.b.worker_id, world.url), "nope"):
            pass


async def test_a_worker_not_served_over_tls_is_refused(world: World) -> None:
    with pytest.raises(WorkerError, match="not served over TLS"):
        await world.client.health(Worker(world.a.worker_id, world.url.replace("https", "http")))


def _caller(world: World, chain: tuple[Path, Path] | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(world.a.files.ca))
    if chain is not None:
        ctx.load_cert_chain(*chain)
    return ctx


async def _get_health(world: World, ctx: ssl.SSLContext) -> httpx.Response:
    async with world.raw(ctx) as http:
        return await http.get(
            f"{world.url}/health", extensions={"sni_hostname": worker_name(world.a.worker_id)}
        )


async def test_a_caller_without_a_certificate_is_refused(world: World) -> None:
    with pytest.raises(httpx.TransportError):
        await _get_health(world, _caller(world, None))


async def test_a_caller_with_a_workers_certificate_is_refused(world: World) -> None:
    """A worker's certificate serves only: another worker cannot call this one with it."""
    with pytest.raises(httpx.TransportError):
        await _get_health(world, _caller(world, (world.b.files.cert, world.b.files.key)))


async def test_a_caller_with_a_certificate_of_another_ca_is_refused(
    world: World, tmp_path: Path
) -> None:
    other = make_worker_ca(tmp_path).client_context()
    other.load_verify_locations(cafile=str(world.a.files.ca))  # it trusts the worker
    with pytest.raises(httpx.TransportError):
        await _get_health(world, other)


async def test_the_same_caller_with_the_control_planes_certificate_gets_in(world: World) -> None:
    """The refusals above are the certificate's: the same raw call with the control plane's
    context (and the same bearer secret) is answered."""
    resp = await _get_health(world, world.ca.client_context())
    assert resp.status_code == 200 and resp.json()["worker_id"] == world.a.worker_id


def test_a_certificate_is_issued_only_for_the_requesters_key_and_named_worker(
    world: World, tmp_path: Path
) -> None:
    mine = WorkerIdentity(tmp_path / "c", "wc")
    cert = world.ca.issue("wd", mine.request())  # the control plane names someone else
    with pytest.raises(Exception, match="does not name this worker"):
        mine.accept(cert, world.ca.ca_pem)
    with pytest.raises(Exception, match="not for this worker's key"):
        mine.accept(world.ca.issue("wc", world.b.request()), world.ca.ca_pem)
    assert not mine.present()


async def test_a_tls_worker_stops_at_once_though_callers_keep_idle_connections(
    world: World, runtime: LocalRuntime
) -> None:
    """Closing TLS waits for the peer's close_notify, which a caller's idle pooled connection
    never sends: the worker must not wait for it (it would add the whole graceful-shutdown
    time to every restart, and the control plane would see each restart as a lost worker)."""
    port = free_port()
    vms = manager(runtime, world.a.worker_id)
    server = asyncio.ensure_future(serve(vms, SECRET, "127.0.0.1", port, tls=world.a.files))
    target = Worker(world.a.worker_id, f"https://127.0.0.1:{port}")
    client = WorkerClient(SECRET, tls=world.ca.client_context())
    try:
        for _ in range(200):
            try:
                await client.health(target)  # leaves a kept-alive connection in the pool
                break
            except WorkerError:
                await asyncio.sleep(0.05)
        started = time.monotonic()
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        assert time.monotonic() - started < 2.0
    finally:
        await client.close()

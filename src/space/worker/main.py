"""The worker process (`space worker`): adopt this host's VMs, keep its gateway up, serve, and
register at the control plane (it has no database credentials)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from pathlib import Path

from prometheus_client import CollectorRegistry

from space import crashpoints, tracing
from space.identity import IdentityError, TLSFiles, WorkerIdentity
from space.metrics_server import serve_metrics
from space.settings import Settings, WorkerSettings
from space.worker import ksm, netsetup
from space.worker.api.server import serve
from space.worker.artifacts import Artifacts
from space.worker.fence import Fence
from space.worker.local import local_runtime
from space.worker.metrics import SandboxCollector
from space.worker.network.supervisor import GatewaySupervisor
from space.worker.registration import ControlPlane, Refused
from space.worker.sandboxes import ManagerOptions, VMManager
from space.worker.sandboxes.records import EPOCH_FILE
from space.worker.sandboxes.recovery import Watch

log = logging.getLogger(__name__)


async def _identity(ws: WorkerSettings, directory: Path, worker_id: str) -> TLSFiles | None:
    """Under mutual TLS, this worker's certificate: the one it keeps, or one it gets now for
    its join token."""
    if not ws.tls:
        return None
    identity = WorkerIdentity(directory, worker_id)
    if identity.present():
        return identity.files
    try:
        if ws.join_token_file is None or not ws.control_url:
            raise OSError("no SPACE_WORKER_JOIN_TOKEN_FILE or SPACE_CONTROL_URL")
        token = ws.join_token_file.read_text().strip()
    except OSError as e:
        raise SystemExit(
            "SPACE_WORKER_TLS=1 and this worker has no certificate yet: it needs a join token "
            f"(`space admin join-token {worker_id}`) in the file SPACE_WORKER_JOIN_TOKEN_FILE "
            f"names and the API's address in SPACE_CONTROL_URL ({e})"
        ) from None
    try:
        return await identity.join(ws.control_url, token)
    except IdentityError as e:
        raise SystemExit(str(e)) from None


async def _listening(host: str, port: int, serving: asyncio.Future[None]) -> None:
    probe = "127.0.0.1" if host == "0.0.0.0" else host
    while not serving.done():
        try:
            _, writer = await asyncio.open_connection(probe, port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        return
    serving.result()  # it ended before it listened: say why


async def run(settings: Settings, *, worker_id: str, host: str, port: int, url: str) -> None:
    crashpoints.arm(settings.crash_at)
    tracing.start("worker", settings.otlp_endpoint)
    ws = settings.worker
    if not ws.control_url:
        raise SystemExit("SPACE_CONTROL_URL must name the API: a worker registers there")
    if ws.driver == "firecracker" and ws.network and not ws.jail.enabled:
        raise SystemExit(
            "the Firecracker driver opens its tap by name inside the sandbox's network "
            "namespace, which needs its jailer: run it with SPACE_WORKER_JAIL=1 (or "
            "SPACE_WORKER_NETWORK=0)"
        )
    runtime = await local_runtime(ws)
    if problem := ksm.configure(ws.ksm, ws.ksm_pages_to_scan, ws.ksm_sleep_ms):
        log.warning("%s", problem)
    egress, gateway = None, None
    root = runtime.pool.root / "workers" / worker_id
    if ws.network:
        egress, gateway = await netsetup.start_egress(settings, worker_id, root)
    try:
        manager = VMManager(
            runtime.driver, runtime.pool, runtime.images, worker_id,
            ManagerOptions(capacity_vcpus=ws.vcpus or None,
                           capacity_memory_mib=ws.memory_mib or None,
                           vcpu_overcommit=ws.vcpu_overcommit, admit_memory=ws.admit_memory,
                           reserve_mib=ws.reserve_mib, base_snapshots=ws.base_snapshots),
            egress, Artifacts(ws.registry) if ws.registry.url else None,
        )  # fmt: skip
        await manager.start()  # re-adopt before announcing ourselves, so recovery finds the VMs
        supervisor = GatewaySupervisor(gateway, egress) if gateway and egress else None
        try:
            await _serve(settings, manager, supervisor, worker_id, host, port, url)
        finally:
            await manager.close(stop_vms=False)  # VMs outlive the process; the next adopts them
    finally:
        if gateway is not None:
            await gateway.stop()
        tracing.stop()


async def _serve(
    settings: Settings,
    manager: VMManager,
    supervisor: GatewaySupervisor | None,
    worker_id: str,
    host: str,
    port: int,
    url: str,
) -> None:
    def problems() -> list[str]:
        if supervisor is not None and not supervisor.up:
            return [supervisor.problem or "the gateway is down"]
        return []

    registry = CollectorRegistry()
    registry.register(SandboxCollector(manager, asyncio.get_running_loop()))
    serve_metrics(settings.worker.metrics_address, settings.load_metrics_token(), registry)
    instance = secrets.token_hex(8)
    fence = Fence(manager.root / EPOCH_FILE)
    tls = await _identity(settings.worker, manager.root / "identity", worker_id)
    secret = settings.load_worker_secret()
    serving = asyncio.ensure_future(
        serve(manager, secret, host, port, fence=fence,
              problems=problems, instance=instance, tls=tls)
    )  # fmt: skip
    # Registered only once it answers: the API calls it back, and a caller picking it at once
    # must reach it. What it admits is what its health says (after its reserve).
    await _listening(host, port, serving)
    control = ControlPlane(settings.worker.control_url, secret, worker_id, instance)
    tasks = [serving, asyncio.ensure_future(control.run(url)),
             asyncio.ensure_future(Watch(manager).run())]  # fmt: skip
    if supervisor is not None:
        tasks.append(asyncio.ensure_future(supervisor.run()))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # why it ended, if it failed
    except Refused as e:
        raise SystemExit(str(e)) from None
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await control.close()

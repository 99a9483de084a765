"""`space api`, `space controller`, `space worker` (one process each) and `space up` (all of them).

`space up` is the one-machine deployment: embedded PostgreSQL, the images, then the three
services as child processes; it prints the URL and an API key and stays in the foreground.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import click
import httpx

from space import interpreter, logs
from space.client._config import (
    Credentials,
    credentials_path,
    resolve_credentials,
    save_credentials,
)
from space.client._errors import SpaceError
from space.db import embedded, migrate
from space.db.store import Store, connect
from space.settings import Settings

log = logging.getLogger(__name__)


@click.command()
@click.option("--host", help="address to listen on (default SPACE_API_HOST, 127.0.0.1)")
@click.option("--port", type=int, help="port to listen on (default SPACE_API_PORT, 8080)")
def api(host: str | None, port: int | None) -> None:
    """Run the HTTP API server."""
    from space.api.app import serve

    settings = Settings.from_env()
    api_settings = replace(
        settings.api, host=host or settings.api.host, port=port or settings.api.port
    )
    settings = replace(settings, api=api_settings)
    logs.setup(settings.log.format, settings.log.level, "api")
    asyncio.run(serve(settings, _database(settings)))


@click.command()
def controller() -> None:
    """Run a controller replica (one leads; the others stand by)."""
    from space.controller.main import run

    settings = Settings.from_env()
    logs.setup(settings.log.format, settings.log.level, "controller")
    asyncio.run(run(settings, _database(settings)))


@click.command()
@click.option("--id", "worker_id", default=lambda: os.uname().nodename, show_default="hostname")
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8091, show_default=True)
@click.option(
    "--url", help="how the API and controller reach this worker (default from --host/--port)"
)
def worker(worker_id: str, host: str, port: int, url: str | None) -> None:
    """Run the worker service of this host."""
    from space.worker.main import run

    settings = Settings.from_env()
    logs.setup(settings.log.format, settings.log.level, "worker", worker=worker_id)
    asyncio.run(
        run(settings, worker_id=worker_id, host=host, port=port,
            url=url or f"{'https' if settings.worker.tls else 'http'}://{host}:{port}")
    )  # fmt: skip


def _database(settings: Settings) -> str:
    return embedded.database_url(settings.database_url, settings.state_dir)


async def _bootstrap(url: str, api_url: str, pool: int) -> str:
    """Schema, the `base` template and its warm pool, the default tenant and an admin API key
    (reused if still valid)."""
    store = Store(connect(url))
    try:
        await migrate.upgrade(store.engine)
        await store.ensure_template("base")
        try:
            saved: str | None = resolve_credentials(api_url).api_key
        except SpaceError:
            saved = None
        known = await store.authenticate(saved) if saved else None
        if saved is None or known is None or not known.admin:
            # The operator's own key: it may also size the warm pools.
            tenant = await store.create_tenant("default")
            saved = await store.create_api_key(tenant.id, "space up", admin=True)
        await store.set_pool("base", pool, 1, 256, 1024)
        save_credentials(Credentials(api_url, saved))
        return saved
    finally:
        await store.close()


def _build_code_interpreter(api_url: str, key: str) -> str:
    """Start the build of the code-interpreter template (its image is made; this only makes it
    a template, in seconds, and is a no-op when nothing changed): what to tell the user."""
    from space.client import Space

    try:
        with Space(api_url, key) as admin:
            admin.build_template("code-interpreter", interpreter.SPEC)
    except SpaceError as e:
        return f"not built: {e}"
    return "(building: `space template ls`; E2B's code interpreter SDK uses it)"


def _die_with_parent() -> None:
    """In the child: if `space up` dies however it dies, the kernel sends us SIGTERM."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """One service of `space up`: started again when it exits, with a growing pause between
    tries (reset once it has run for a while), so one crashing service does not stop the rest
    of the platform, and a service that cannot start does not spin."""

    BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
    STABLE_S = 60.0

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.failures = 0
        self.next_start = 0.0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, preexec_fn=_die_with_parent)
        self.started = time.monotonic()

    def tend(self) -> None:
        """Start it again if it exited and its pause is over."""
        now = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            if now - self.started > self.STABLE_S:
                self.failures = 0
            return
        if self.proc is not None:
            code, self.proc = self.proc.returncode, None
            pause = self.BACKOFF_S[min(self.failures, len(self.BACKOFF_S) - 1)]
            self.failures += 1
            self.next_start = now + pause
            click.echo(f"space up: {self.name} exited with {code}; starting it again in "
                       f"{pause:g} s", err=True)  # fmt: skip
        if now >= self.next_start:
            self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def wait(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _wait_healthy(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise click.ClickException(f"{url} did not answer within {timeout:.0f}s")


def _wait_worker(db_url: str, timeout: float = 120) -> None:
    """Until a worker has registered and can take sandboxes (its first start builds nothing,
    but adopts what a previous run left)."""

    async def ready() -> int:
        store = Store(connect(db_url, pool_size=1))
        try:
            return await store.ready_workers()
        finally:
            await store.close()

    deadline = time.monotonic() + timeout
    while asyncio.run(ready()) == 0:
        if time.monotonic() > deadline:
            raise click.ClickException(f"no worker registered within {timeout:.0f}s")
        time.sleep(0.5)


@click.command()
@click.option("--port", type=int, default=8080, show_default=True, help="API port")
@click.option("--worker-port", type=int, default=8091, show_default=True)
@click.option(
    "--pool",
    type=click.IntRange(0, 1000),
    default=2,
    show_default=True,
    help="warm-pool size of the base template (1 vCPU, 256 MiB, 1 GiB disk)",
)
@click.option(
    "--metrics-port", type=int, default=9464, show_default=True, help="controller metrics"
)
@click.option(
    "--worker-metrics-port", type=int, default=9465, show_default=True, help="worker metrics"
)
def up(port: int, worker_port: int, pool: int, metrics_port: int, worker_metrics_port: int) -> None:
    """Bring the whole platform up on this machine and print how to use it."""
    from space.cli.doctor import require_healthy_host
    from space.cli.images import base_cmd, code_interpreter_cmd, kernel_cmd

    if os.geteuid() != 0:
        raise click.ClickException("space up needs root (VMs, loop devices, network namespaces)")
    require_healthy_host()  # stops on what cannot work, before anything is built or started
    ctx = click.get_current_context()
    ctx.invoke(kernel_cmd, force=False)
    ctx.invoke(base_cmd, force=False)
    ctx.invoke(code_interpreter_cmd, force=False)
    click.secho("space up: database", bold=True, err=True)
    settings = Settings.from_env()
    db_url = _database(settings)
    api_url = f"http://127.0.0.1:{port}"
    key = asyncio.run(_bootstrap(db_url, api_url, pool))
    metrics_token = settings.load_metrics_token()
    space = [sys.executable, "-m", "space.cli.main"]
    env = {
        **os.environ,
        "SPACE_DATABASE_URL": db_url,
        "SPACE_CONTROLLER_METRICS": f"127.0.0.1:{metrics_port}",
        "SPACE_WORKER_METRICS": f"127.0.0.1:{worker_metrics_port}",
        "SPACE_METRICS_TOKEN": metrics_token,
    }
    # The worker registers at the API and never sees the database's address.
    worker_env = {k: v for k, v in env.items() if k != "SPACE_DATABASE_URL"}
    worker_env["SPACE_CONTROL_URL"] = api_url
    children = [
        Child("worker", [*space, "worker", "--port", str(worker_port)], worker_env),
        Child("controller", [*space, "controller"], env),
        Child("api", [*space, "api", "--port", str(port)], env),
    ]
    for child in children:
        child.start()

    def stop(*_: object) -> None:
        # Once stopping, further signals must not interrupt the shutdown half-way.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for child in children:
            child.stop()
        for child in children:
            child.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _wait_healthy(f"{api_url}/healthz")
    click.secho("space up: waiting for the worker", bold=True, err=True)
    _wait_worker(db_url)
    code_interpreter = _build_code_interpreter(api_url, key)
    click.echo(
        f"""
SPACE is up.
  API:      {api_url}   (OpenAPI: {api_url}/openapi.json)
  Console:  {api_url}/console   (sign in with the API key below)
  API key:  {key}
  saved in  {credentials_path()}  (the CLI and SDK read it)
  Metrics:  {api_url}/metrics,  http://127.0.0.1:{metrics_port}/metrics (controller)  and
            http://127.0.0.1:{worker_metrics_port}/metrics (worker: per-sandbox figures)
            with  Authorization: Bearer {metrics_token}
  Warm pool: {pool} base sandboxes kept ready (`space pool set base N` changes it)
  Templates: base; code-interpreter {code_interpreter}

  space sandbox create            # prints a sandbox id
  space exec <id> -- uname -a
  space shell <id>
  python3 -c 'import space; sb = space.Sandbox.create(); print(sb.exec("uname -r").text)'

Ctrl-C stops the services (a service that exits is started again); running VMs are
re-adopted by the next `space up`.
"""
    )
    while True:
        for child in children:
            child.tend()
        time.sleep(0.5)

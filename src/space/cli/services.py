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

import click
import httpx

from space import config
from space.client._config import (
    Credentials,
    credentials_path,
    resolve_credentials,
    save_credentials,
)
from space.client._errors import SpaceError
from space.db import embedded, migrate
from space.db.store import Store, connect

log = logging.getLogger(__name__)


@click.command()
@click.option("--host", default=lambda: config.api_address()[0], show_default="127.0.0.1")
@click.option("--port", type=int, default=lambda: config.api_address()[1], show_default="8080")
def api(host: str, port: int) -> None:
    """Run the HTTP API server."""
    from space.api.app import serve

    asyncio.run(serve(embedded.database_url(), config.worker_secret(), host, port))


@click.command()
def controller() -> None:
    """Run a controller replica (one leads; the others stand by)."""
    from space.controller.main import run

    asyncio.run(run(embedded.database_url(), config.worker_secret()))


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

    asyncio.run(
        run(
            embedded.database_url(),
            config.worker_secret(),
            worker_id=worker_id,
            host=host,
            port=port,
            url=url or f"http://{host}:{port}",
        )
    )


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


def _die_with_parent() -> None:
    """In the child: if `space up` dies however it dies, the kernel sends us SIGTERM."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _name(p: subprocess.Popen[bytes]) -> str:
    args = p.args if isinstance(p.args, list) else [p.args]
    return " ".join(str(a) for a in args[2:])


def _wait_healthy(url: str, procs: list[subprocess.Popen[bytes]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise click.ClickException(f"{_name(p)} exited with {p.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise click.ClickException(f"{url} did not answer within {timeout:.0f}s")


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
def up(port: int, worker_port: int, pool: int, metrics_port: int) -> None:
    """Bring the whole platform up on this machine and print how to use it."""
    from space.cli.images import base_cmd, kernel_cmd

    if os.geteuid() != 0:
        raise click.ClickException("space up needs root (VMs, loop devices, network namespaces)")
    ctx = click.get_current_context()
    ctx.invoke(kernel_cmd, force=False)
    ctx.invoke(base_cmd, force=False)
    click.secho("space up: database", bold=True, err=True)
    db_url = embedded.database_url()
    api_url = f"http://127.0.0.1:{port}"
    key = asyncio.run(_bootstrap(db_url, api_url, pool))
    space = [sys.executable, "-m", "space.cli.main"]
    env = {
        **os.environ,
        "SPACE_DATABASE_URL": db_url,
        "SPACE_CONTROLLER_METRICS": f"127.0.0.1:{metrics_port}",
    }
    procs = [
        subprocess.Popen(
            [*space, "worker", "--port", str(worker_port)], env=env, preexec_fn=_die_with_parent
        ),
        subprocess.Popen([*space, "controller"], env=env, preexec_fn=_die_with_parent),
        subprocess.Popen(
            [*space, "api", "--port", str(port)], env=env, preexec_fn=_die_with_parent
        ),
    ]

    def stop(*_: object) -> None:
        # Once stopping, further signals must not interrupt the shutdown half-way.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _wait_healthy(f"{api_url}/healthz", procs)
    click.echo(
        f"""
SPACE is up.
  API:      {api_url}   (OpenAPI: {api_url}/openapi.json)
  API key:  {key}
  saved in  {credentials_path()}  (the CLI and SDK read it)
  Metrics:  {api_url}/metrics  and  http://127.0.0.1:{metrics_port}/metrics (controller)
  Warm pool: {pool} base sandboxes kept ready (`space pool set base N` changes it)

  space sandbox create            # prints a sandbox id
  space exec <id> -- uname -a
  space shell <id>
  python3 -c 'import space; sb = space.Sandbox.create(); print(sb.exec("uname -r").text)'

Ctrl-C stops the services; running VMs are re-adopted by the next `space up`.
"""
    )
    while True:
        for p in procs:
            if p.poll() is not None:
                click.echo(f"{_name(p)} exited with {p.returncode}; stopping", err=True)
                stop()
        time.sleep(1)

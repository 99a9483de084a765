"""`space admin`: tenants and API keys, straight in the database (operators only).

Keys are shown once, when made: only their hash is stored.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import click

from space.cli import backups
from space.cli.output import json_option, print_json, print_table
from space.db import embedded, migrate
from space.db.sealing import Sealer, SealError
from space.db.store import Store, connect
from space.identity import MAX_WORKER_ID, WORKER_ID
from space.quotas import UNITS, Quotas
from space.settings import Settings, new_sealing_key

if TYPE_CHECKING:
    from space.api.workers import Shares

T = TypeVar("T")


def _run(fn: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        settings = Settings.from_env()
        url = embedded.database_url(settings.database_url, settings.state_dir)
        store = Store(connect(url, pool_size=1))
        try:
            await migrate.upgrade(store.engine)
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


@click.group()
def admin() -> None:
    """Tenants and API keys (operators only: this talks to the database directly)."""


backups.register(admin)


@admin.command("migrate")
def migrate_() -> None:
    """Bring the database to the newest schema and print its revision.

    Every service also upgrades as it starts; a deployment runs this first on a rollout, so new
    pods find their schema ready (concurrent upgrades queue on one advisory lock)."""
    click.echo(_run(lambda store: migrate.revision(store.engine)))


@admin.command("join-token")
@click.argument("worker_id")
@click.option("--ttl", type=click.IntRange(60, 7 * 86400), default=3600, show_default=True,
              help="seconds it may be used within")  # fmt: skip
def join_token(worker_id: str, ttl: int) -> None:
    """Print a one-time token the worker WORKER_ID trades for its certificate (mutual TLS:
    SPACE_WORKER_JOIN_TOKEN_FILE). Shown once; only its hash is stored."""
    if len(worker_id) > MAX_WORKER_ID or not re.fullmatch(WORKER_ID, worker_id):
        raise click.BadParameter("a worker id is a DNS name (lower case)", param_hint="WORKER_ID")
    click.echo(_run(lambda store: store.create_join_token(worker_id, timedelta(seconds=ttl))))


@admin.command("create-key")
@click.argument("tenant")
@click.option("--name", default="", help="a label for the key")
@click.option("--admin", "admin_", is_flag=True, help="may also manage templates and warm pools")
def create_key(tenant: str, name: str, admin_: bool) -> None:
    """Print a new API key for TENANT (a name; the tenant is made if it does not exist)."""

    async def go(store: Store) -> str:
        t = await store.create_tenant(tenant)
        return await store.create_api_key(t.id, name, admin=admin_)

    try:
        click.echo(_run(go))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@admin.command("revoke-key")
@click.argument("key_id")
def revoke_key(key_id: str) -> None:
    """Revoke a key by its id (the 12 characters after `sk_space_`)."""
    if not _run(lambda store: store.revoke_api_key(key_id)):
        raise click.ClickException(f"no active key {key_id}")
    click.echo(f"revoked {key_id}")


@admin.command("quota")
@click.argument("tenant")
@click.option("--set", "changes", multiple=True, metavar="NAME=N",
              help=f"override one quota ({', '.join(UNITS)}); repeat for more")  # fmt: skip
@click.option("--reset", is_flag=True, help="back to the deployment's defaults (SPACE_QUOTA_*)")
def quota(tenant: str, changes: tuple[str, ...], reset: bool) -> None:
    """Show TENANT's quotas and use, after the overrides given (kept in the database)."""
    overrides: dict[str, int] = {}
    for change in changes:
        name, sep, value = change.partition("=")
        if not sep or not value.strip().isdigit():
            raise click.BadParameter(f"{change!r} is not NAME=N", param_hint="--set")
        overrides[name.strip()] = int(value)
    settings = Settings.from_env()

    async def go(store: Store) -> tuple[Quotas, dict[str, int]]:
        found = await store.tenant_named(tenant)
        if found is None:
            raise click.ClickException(f"no tenant {tenant!r}")
        if reset or overrides:
            current = {} if reset else (await store.quota_overrides(found.id))
            await store.set_quotas(found.id, {**current, **overrides})
        return await store.quotas_of(found.id, settings.quotas)

    try:
        limits, used = _run(go)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    for name, limit in limits.as_dict().items():
        click.echo(f"{name:<12} {used[name]:>10} of {limit:<10} {UNITS[name]}")


@admin.command("workers")
@json_option
def workers(as_json: bool) -> None:
    """The hosts: what each admits, what admission counts in use (measured), and its health."""
    from space.api.workers import describe

    async def go(store: Store) -> list[Any]:
        return describe(await store.workers(), await store.worker_load())

    items = _run(go)
    if as_json:
        print_json([i.model_dump(mode="json") for i in items])
        return
    print_table(
        ("ID", "RELEASE", "STATE", "SANDBOXES", "VCPUS", "MEMORY (MEASURED)", "GUEST RAM",
         "EACH SANDBOX: DISK, NET", "PROBLEM"),
        [(i.id, i.version, i.state, f"{i.sandboxes} ({i.pool_members} pool)",
          f"{i.vcpus_used}/{i.vcpus}",
          f"{i.memory_used_mib}/{i.memory_mib} MiB", f"{i.guest_memory_mib} MiB",
          _shares(i.shares), i.problem or "") for i in items],
        empty="no workers",
    )  # fmt: skip


def _shares(s: Shares) -> str:
    disk = [f"{s.disk_mib_s} MiB/s"] if s.disk_mib_s else []
    disk += [f"{s.disk_iops} IOPS"] if s.disk_iops else []
    net = f"{s.net_mbit} Mbit/s" if s.net_mbit else "unlimited"
    return f"{' '.join(disk) or 'unlimited'}, {net}"


@admin.command("drain")
@click.argument("worker_id")
@click.option("--undo", is_flag=True, help="let the worker take work again")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="follow until all that can leave has left")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(1), default=900.0, show_default=True)
def drain(worker_id: str, undo: bool, wait: bool, timeout: float) -> None:
    """Keep new sandboxes off a worker and move what it runs to others: pool members are let
    go (pools refill elsewhere), running sandboxes are suspended and resumed on another worker,
    suspended ones are moved; those with volumes stay."""
    from space.controller.moves import to_move

    async def mark(store: Store) -> bool:
        return await store.set_draining(worker_id, not undo) is not None

    if not _run(mark):
        raise click.ClickException(f"no worker {worker_id}")
    if undo:
        click.echo(f"worker {worker_id} takes work again")
        return

    async def status(store: Store) -> tuple[list[str], dict[str, str]]:
        worker = await store.worker(worker_id)
        assert worker is not None
        rows = await store.on_worker(worker_id)
        return to_move(worker, rows, await store.with_checkpoints([r["id"] for r in rows]))

    leaving, staying = _run(status)
    started = set(leaving)

    async def not_done(store: Store) -> list[str]:
        """Those still to leave, and those that left and are not settled elsewhere yet."""
        here, _ = await status(store)
        moving = []
        for sandbox_id in started - set(here):
            row = await store.get_sandbox(sandbox_id)
            if row["state"] in ("pending", "starting", "suspending", "resuming"):
                moving.append(sandbox_id)
        return here + moving

    if wait and leaving:
        _follow_drain(worker_id, len(leaving), lambda: _run(not_done), timeout)
    leaving, staying = _run(status)
    for sandbox_id, why in sorted(staying.items()):
        click.echo(f"{sandbox_id} stays: {why}")
    if leaving:
        click.echo(f"worker {worker_id} is draining: {len(leaving)} sandboxes still to move")
    else:
        click.echo(f"worker {worker_id} is drained" + (f"; {len(staying)} stay" if staying else ""))


def _follow_drain(
    worker_id: str, total: int, left: Callable[[], list[str]], timeout: float
) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    deadline = time.monotonic() + timeout
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True)) as progress:  # fmt: skip
        task = progress.add_task(f"draining {worker_id}", total=total)
        while (remaining := len(left())) and time.monotonic() < deadline:
            progress.update(task, completed=max(total - remaining, 0))
            time.sleep(1.0)
        progress.update(task, completed=total - remaining)


@admin.command("rotate-secrets-key")
def rotate_secrets_key() -> None:
    """Seal every secret with a new key (the old ones stay readable until this finishes).

    With SPACE_SECRETS_KEYS set, put a new key first in it (id:base64 of 32 bytes) for every
    process, then run this; without it, this makes the new key itself. Running processes pick
    the new key up when they first meet a value sealed with it."""
    settings = Settings.from_env()
    path = settings.state_secret_path("secrets-keys")
    if not settings.secrets_keys:
        keys = path.read_text().strip() if path.exists() else ""
        tmp = path.with_name(f".secrets-keys.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(",".join(k for k in (new_sealing_key(), keys) if k))
        tmp.replace(path)
    sealer = Sealer(settings.load_sealing_keys())
    try:
        n = _run(lambda store: store.reseal_secrets(sealer))
    except SealError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n} secrets sealed again with key {sealer.current}")

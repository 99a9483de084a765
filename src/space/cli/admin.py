"""`space admin`: tenants and API keys, straight in the database (operators only).

Keys are shown once, when made: only their hash is stored.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from space.config import new_sealing_key, sealing_keys, state_secret_path
from space.db import embedded, migrate
from space.db.sealing import Sealer, SealError
from space.db.store import Store, connect

T = TypeVar("T")


def _run(fn: Callable[[Store], Awaitable[T]]) -> T:
    async def go() -> T:
        store = Store(connect(embedded.database_url(), pool_size=1))
        try:
            await migrate.upgrade(store.engine)
            return await fn(store)
        finally:
            await store.close()

    return asyncio.run(go())


@click.group()
def admin() -> None:
    """Tenants and API keys (operators only: this talks to the database directly)."""


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


@admin.command("rotate-secrets-key")
def rotate_secrets_key() -> None:
    """Seal every secret with a new key (the old ones stay readable until this finishes).

    With SPACE_SECRETS_KEYS set, put a new key first in it (id:base64 of 32 bytes) for every
    process, then run this; without it, this makes the new key itself. Running processes pick
    the new key up when they first meet a value sealed with it."""
    path = state_secret_path("secrets-keys")
    if not os.environ.get("SPACE_SECRETS_KEYS"):
        keys = path.read_text().strip() if path.exists() else ""
        tmp = path.with_name(f".secrets-keys.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(",".join(k for k in (new_sealing_key(), keys) if k))
        tmp.replace(path)
    sealer = Sealer(sealing_keys())
    try:
        n = _run(lambda store: store.reseal_secrets(sealer))
    except SealError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n} secrets sealed again with key {sealer.current}")

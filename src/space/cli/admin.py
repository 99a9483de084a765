"""`space admin`: tenants and API keys, straight in the database (operators only).

Keys are shown once, when made: only their hash is stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import click

from space.db import embedded, migrate
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

"""`space admin backup`, `restore` and `strays`: the database's backups, and the sandboxes a
restored database does not know (docs/upgrading.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from space.cli.output import json_option, print_json, print_table
from space.db import backup as backups
from space.db import embedded, migrate
from space.db.store import Store, connect
from space.settings import Settings


def _url() -> str:
    settings = Settings.from_env()
    return embedded.database_url(settings.database_url, settings.state_dir)


def register(admin: click.Group) -> None:
    admin.add_command(backup)
    admin.add_command(restore)
    admin.add_command(strays)


@click.command("backup")
@click.argument("dest", type=click.Path(dir_okay=False, path_type=Path))
def backup(dest: Path) -> None:
    """Write the whole database to DEST (PostgreSQL's custom format; secrets stay sealed)."""
    try:
        size = asyncio.run(backups.backup(_url(), dest))
    except backups.BackupError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"backed up to {dest} ({size} bytes)")


@click.command("restore")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--yes", is_flag=True, help="replace the database's contents: no question asked")
def restore(src: Path, yes: bool) -> None:
    """Replace the database's contents with the backup SRC. Sandboxes made since are kept on
    their workers and reported (`space admin strays`); rows whose VMs are gone turn to error
    with the reason. Stop the controllers first (and the API, or it answers from a database
    that is being replaced)."""
    if not yes:
        click.confirm(f"replace every row of the database with {src}?", abort=True)
    url = _url()

    async def go() -> int:
        store = Store(connect(url, pool_size=1))
        try:
            epoch = await backups.restore(url, src, store.engine)
            await migrate.upgrade(store.engine)  # a backup of an earlier release
            return epoch
        finally:
            await store.close()

    try:
        epoch = asyncio.run(go())
    except backups.BackupError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"restored {src}; the next leader's epoch is above {epoch}")


@click.command("strays")
@click.option("--discard", "discard", metavar="ID", multiple=True,
              help="let the worker delete this stray sandbox's VM, disk and snapshots")  # fmt: skip
@json_option
def strays(discard: tuple[str, ...], as_json: bool) -> None:
    """Sandboxes a worker holds that the database has never heard of (made after the backup it
    was restored from): kept until an operator discards them."""
    url = _url()

    async def go() -> list[tuple[str, str, bool]]:
        store = Store(connect(url, pool_size=1))
        try:
            await migrate.upgrade(store.engine)
            for stray_id in discard:
                if not await store.discard_stray(stray_id):
                    raise click.ClickException(f"no stray sandbox {stray_id} on any worker")
            return await store.strays()
        finally:
            await store.close()

    found = asyncio.run(go())
    if as_json:
        print_json([{"id": i, "worker_id": w, "discarded": d} for i, w, d in found])
        return
    print_table(("ID", "WORKER", "DECISION"),
                [(i, w, "discarded: deleted at the next clean-up" if d else "kept")
                 for i, w, d in found], empty="no strays")  # fmt: skip

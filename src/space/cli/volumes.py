"""`space volume ...`: disks that outlive sandboxes, through the HTTP API."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from space.cli.sandbox import _api_command, _local_time
from space.client import AsyncSpace


@click.group()
def volume() -> None:
    """Volumes: mount one in a sandbox with `space sandbox create --volume ID:/path[:ro]`."""


@volume.command("create")
@click.option("--name", default="", help="a label")
@click.option("--size", type=click.IntRange(16), default=1024, show_default=True, help="MiB")
@_api_command
async def create(space: AsyncSpace, name: str, size: int) -> None:
    """Create an empty volume; prints its id."""
    click.echo((await space.create_volume(size, name)).id)


@volume.command("ls")
@_api_command
async def ls(space: AsyncSpace) -> None:
    table = Table("ID", "NAME", "SIZE", "STATE", "CREATED", box=None)
    for v in await space.volumes():
        table.add_row(v.id, v.name, f"{v.size_mib} MiB", v.state, _local_time(v.created_at))
    Console().print(table)


@volume.command("rm")
@click.argument("volume_id")
@_api_command
async def rm(space: AsyncSpace, volume_id: str) -> None:
    """Delete a volume and its data (refused while a sandbox has it)."""
    await space.delete_volume(volume_id)
    click.echo(volume_id)

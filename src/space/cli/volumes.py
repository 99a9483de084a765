"""`space volume ...`: disks that outlive sandboxes, through the HTTP API."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from space.cli.output import json_option, print_json, print_table
from space.cli.sandbox import _api_command, _local_time

if TYPE_CHECKING:
    from space.client import Space


@click.group()
def volume() -> None:
    """Volumes: mount one in a sandbox with `space sandbox create --volume ID:/path[:ro]`."""


@volume.command("create")
@click.option("--name", default="", help="a label")
@click.option("--size", type=click.IntRange(16), default=1024, show_default=True, help="MiB")
@_api_command
def create(space: Space, name: str, size: int) -> None:
    """Create an empty volume; prints its id."""
    click.echo(space.create_volume(size, name).id)


@volume.command("ls")
@json_option
@_api_command
def ls(space: Space, as_json: bool) -> None:
    """List the volumes, with their size and state."""
    volumes = space.volumes()
    if as_json:
        print_json(volumes)
        return
    print_table(
        ("ID", "NAME", "SIZE", "STATE", "CREATED"),
        [(v.id, v.name, f"{v.size_mib} MiB", v.state, _local_time(v.created_at)) for v in volumes],
        empty="no volumes",
    )


@volume.command("rm")
@click.argument("volume_id")
@_api_command
def rm(space: Space, volume_id: str) -> None:
    """Delete a volume and its data (refused while a sandbox has it)."""
    space.delete_volume(volume_id)
    click.echo(volume_id)

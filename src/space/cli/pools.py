"""`space pool ...`: the templates' warm pools, through the HTTP API."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from space.cli.sandbox import _api_command
from space.client import AsyncSpace, TemplateInfo


@click.group()
def pool() -> None:
    """Warm pools: sandboxes kept restored and ready, so creates of their shape take a claim."""


def _table(templates: list[TemplateInfo]) -> Table:
    table = Table("TEMPLATE", "SIZE", "READY", "STARTING", "SHAPE", box=None)
    for t in templates:
        p = t.pool
        shape = f"{p.vcpus} vCPU, {p.memory_mib} MiB, {p.disk_mib} MiB disk"
        table.add_row(t.id, str(p.size), str(p.ready), str(p.starting), shape)
    return table


@pool.command("ls")
@_api_command
async def ls(space: AsyncSpace) -> None:
    """Every template's pool: asked size, members ready and starting, and their shape."""
    Console().print(_table(await space.templates()))


@pool.command("set")
@click.argument("template")
@click.argument("size", type=click.IntRange(0, 1000))
@click.option("--vcpus", type=click.IntRange(1), help="vCPUs of each member  [default: 1]")
@click.option("--memory", type=click.IntRange(1), help="MiB of memory  [default: 256]")
@click.option("--disk", type=click.IntRange(1), help="MiB of disk  [default: 1024]")
@_api_command
async def set_(
    space: AsyncSpace,
    template: str,
    size: int,
    vcpus: int | None,
    memory: int | None,
    disk: int | None,
) -> None:
    """Keep SIZE sandboxes of TEMPLATE ready (0 turns the pool off; needs an admin key)."""
    info = await space.set_pool(template, size, vcpus=vcpus, memory_mib=memory, disk_mib=disk)
    Console().print(_table([info]))

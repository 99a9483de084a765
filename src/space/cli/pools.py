"""`space pool ...`: the templates' warm pools, through the HTTP API."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import click

from space.cli.output import json_option, print_json, print_table
from space.cli.sandbox import _api_command

if TYPE_CHECKING:
    from space.client import Space, TemplateInfo


@click.group()
def pool() -> None:
    """Warm pools: sandboxes kept restored and ready, so creates of their shape take a claim."""


def _show(templates: list[TemplateInfo], as_json: bool) -> None:
    if as_json:
        print_json([{"template": t.id, **dataclasses.asdict(t.pool)} for t in templates])
        return
    rows = []
    for t in templates:
        p = t.pool
        shape = f"{p.vcpus} vCPU, {p.memory_mib} MiB, {p.disk_mib} MiB disk"
        rows.append((t.id, str(p.size), str(p.ready), str(p.starting), shape))
    print_table(("TEMPLATE", "SIZE", "READY", "STARTING", "SHAPE"), rows, empty="no templates")


@pool.command("ls")
@json_option
@_api_command
def ls(space: Space, as_json: bool) -> None:
    """Every template's pool: asked size, members ready and starting, and their shape."""
    _show(space.templates(), as_json)


@pool.command("set")
@click.argument("template")
@click.argument("size", type=click.IntRange(0, 1000))
@click.option("--vcpus", type=click.IntRange(1), help="vCPUs of each member  [default: 1]")
@click.option("--memory", type=click.IntRange(1), help="MiB of memory  [default: 256]")
@click.option("--disk", type=click.IntRange(1), help="MiB of disk  [default: 1024]")
@json_option
@_api_command
def set_(
    space: Space,
    template: str,
    size: int,
    vcpus: int | None,
    memory: int | None,
    disk: int | None,
    as_json: bool,
) -> None:
    """Keep SIZE sandboxes of TEMPLATE ready (0 turns the pool off; needs an admin key)."""
    info = space.set_pool(template, size, vcpus=vcpus, memory_mib=memory, disk_mib=disk)
    _show([info], as_json)

"""The `space` command."""

from __future__ import annotations

import logging

import click

from space import __version__
from space.cli.admin import admin
from space.cli.images import image
from space.cli.pools import pool
from space.cli.sandbox import cp, exec_, sandbox, shell
from space.cli.services import api, controller, up, worker
from space.cli.templates import template
from space.cli.vm import vm
from space.cli.volumes import volume


@click.group()
@click.version_option(__version__, prog_name="space")
@click.option("-v", "--verbose", is_flag=True, help="Log what happens underneath.")
def cli(verbose: bool) -> None:
    """SPACE: sandboxed microVMs for agents."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


cli.add_command(vm)
cli.add_command(image)
cli.add_command(sandbox)
cli.add_command(exec_)
cli.add_command(shell)
cli.add_command(cp)
cli.add_command(template)
cli.add_command(pool)
cli.add_command(volume)
for command in (up, api, controller, worker, admin):
    cli.add_command(command)


def main() -> None:
    cli()


if __name__ == "__main__":
    main()

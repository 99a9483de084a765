"""`space secret ...`: the tenant's secrets, by name, through the HTTP API (never a value
printed; one is read from stdin, so it stays out of the shell's history and `ps`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from space.cli.output import json_option, print_json, print_table
from space.cli.sandbox import _api_command, _local_time

if TYPE_CHECKING:
    from space.client import Space

MAX_VALUE = 64 << 10  # what the API takes as one secret


@click.group()
def secret() -> None:
    """Secrets: bind one to a sandbox's hosts with `space sandbox create --secret`."""


@secret.command("set")
@click.argument("name")
@_api_command
def set_(space: Space, name: str) -> None:
    """Create or replace secret NAME with the value read from stdin (a final newline is
    dropped)."""
    if sys.stdin.isatty():
        value = click.prompt(f"value of {name}", hide_input=True, err=True)
    else:
        value = sys.stdin.read(MAX_VALUE + 2)
    value = value.removesuffix("\n").removesuffix("\r")
    if not value:
        raise click.UsageError("the value (from stdin) is empty")
    if len(value) > MAX_VALUE:
        raise click.UsageError(f"the value is longer than {MAX_VALUE} characters")
    click.echo(space.set_secret(name, value).name)


@secret.command("ls")
@json_option
@_api_command
def ls(space: Space, as_json: bool) -> None:
    """List the secrets' names (never their values)."""
    found = space.secrets()
    if as_json:
        print_json(found)
        return
    print_table(
        ("NAME", "CREATED", "UPDATED"),
        [(s.name, _local_time(s.created_at), _local_time(s.updated_at)) for s in found],
        empty="no secrets",
    )


@secret.command("rm")
@click.argument("name")
@_api_command
def rm(space: Space, name: str) -> None:
    """Delete a secret (refused while a sandbox that is not deleted has it bound)."""
    space.delete_secret(name)
    click.echo(name)

"""`space checkpoint ...` and `space fork`: a sandbox's checkpoints, rollbacks and forks,
through the HTTP API."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import click

from space.cli.completion import complete_sandbox_ids
from space.cli.output import json_option, print_json, print_table
from space.cli.sandbox import _api_command, _env_option, _local_time, _pairs_option

if TYPE_CHECKING:
    from space.client import Sandbox, Space

MAX_FORK = 16  # the API's bound (docs/api.md)


def _sandbox(space: Space, sandbox_id: str) -> Sandbox:
    from space.client import Sandbox

    return Sandbox.get(sandbox_id, client=space)


@click.group()
def checkpoint() -> None:
    """Checkpoints: a sandbox's memory and disk at one moment, to roll back to, fork from or
    make a template of."""


@checkpoint.command("create")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.option("--name", default="", help="a label")
@json_option
@_api_command
def create(space: Space, sandbox_id: str, name: str, as_json: bool) -> None:
    """Checkpoint a running sandbox (it runs on, paused briefly); prints the checkpoint's id."""
    taken = _sandbox(space, sandbox_id).checkpoint(name)
    if as_json:
        print_json(taken)
    else:
        click.echo(taken.id)


@checkpoint.command("ls")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@json_option
@_api_command
def ls(space: Space, sandbox_id: str, as_json: bool) -> None:
    """List a sandbox's checkpoints, oldest first."""
    found = _sandbox(space, sandbox_id).checkpoints()
    if as_json:
        print_json(found)
        return
    rows = [
        (k.id, k.name, k.state, f"{k.size_bytes >> 20} MiB",
         f"{k.paused_ms:.0f} ms" if k.paused_ms is not None else "-", _local_time(k.created_at))
        for k in found
    ]  # fmt: skip
    print_table(("ID", "NAME", "STATE", "SIZE", "PAUSED", "CREATED"), rows, empty="no checkpoints")


@checkpoint.command("rm")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("checkpoint_id")
@_api_command
def rm(space: Space, sandbox_id: str, checkpoint_id: str) -> None:
    """Delete a checkpoint (its files go from the worker)."""
    _sandbox(space, sandbox_id).delete_checkpoint(checkpoint_id)
    click.echo(checkpoint_id)


@checkpoint.command("rollback")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("checkpoint_id")
@_api_command
def rollback(space: Space, sandbox_id: str, checkpoint_id: str) -> None:
    """Roll a running sandbox back to a checkpoint: its processes and files as they were."""
    info = _sandbox(space, sandbox_id).rollback(checkpoint_id)
    click.echo(f"{info.id} {info.state}")


@checkpoint.command("template")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("checkpoint_id")
@click.argument("name")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="seconds")
@_api_command
def template(space: Space, sandbox_id: str, checkpoint_id: str, name: str, timeout: float) -> None:
    """Make template NAME of a checkpoint (admin keys only): sandboxes of it start as the
    checkpoint was, processes running. Streams the worker's log; prints NAME and its digest."""
    space.template_from_checkpoint(name, sandbox_id, checkpoint_id)
    for line in space.build_log(name):
        click.echo(line, err=True)
    # The log ends with the build; its outcome reaches the API a moment later.
    deadline = time.monotonic() + timeout
    while (made := space.template(name)).state in ("queued", "building"):
        if time.monotonic() > deadline:
            raise click.ClickException(f"template {name} is still {made.state}")
        time.sleep(0.2)
    if made.state != "ready":
        raise click.ClickException(f"template {name}: {made.state}: {made.error}")
    click.echo(f"{name} {(made.built or {}).get('digest')}")


@click.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.option("--count", "-n", type=click.IntRange(1, MAX_FORK), default=1, show_default=True)
@click.option("--checkpoint", "checkpoint_id", help="Fork this checkpoint, not the state now.")
@_env_option
@_pairs_option("--metadata", "-m", help="A label of the children's. Repeatable.")
@json_option
@_api_command
def fork(
    space: Space,
    sandbox_id: str,
    count: int,
    checkpoint_id: str | None,
    env: dict[str, str],
    metadata: dict[str, str],
    as_json: bool,
) -> None:
    """Make running children of a sandbox (it runs on); prints their ids, one a line."""
    children = _sandbox(space, sandbox_id).fork(
        count, checkpoint=checkpoint_id, env=env, metadata=metadata
    )
    if as_json:
        print_json([child.info for child in children])
        return
    for child in children:
        click.echo(child.id)

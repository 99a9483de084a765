"""`space process ...`: a sandbox's background processes through the HTTP API: list them,
follow one (its kept output first), give it input, signal or kill it. A process is named by
its pid or its tag; `space exec --background` starts one."""

from __future__ import annotations

import signal as signals
import sys
from typing import TYPE_CHECKING

import click

from space.cli.completion import complete_sandbox_ids
from space.cli.output import json_option, print_json, print_table
from space.cli.sandbox import _api_command, _local_time, _status, print_output

if TYPE_CHECKING:
    from space.client import Processes, Space


def _processes(space: Space, sandbox_id: str) -> Processes:
    from space.client import Processes

    return Processes(space, sandbox_id)


def _ref(ref: str) -> str | int:
    return int(ref) if ref.isdigit() else ref


def _signal(_ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A signal by number, or by name with or without SIG (TERM, SIGINT, 9)."""
    if value.isdigit():
        return int(value)
    name = value.upper()
    try:
        return int(signals.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
        raise click.BadParameter(f"{value!r} is not a signal name or number", param=param) from None


@click.group()
def process() -> None:
    """Background processes: list, follow, send input, signal, kill."""


@process.command("ls")
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@json_option
@_api_command
def ls(space: Space, sandbox_id: str, as_json: bool) -> None:
    """The sandbox's running processes, and the background ones that ended lately."""
    found = _processes(space, sandbox_id).list()
    if as_json:
        print_json(found)
        return
    rows = [
        (str(p.pid), p.tag or "-", "running" if p.running else
         f"exit {p.exit_code}" if p.exit_code is not None else f"signal {p.signal}",
         "bg" if p.background else "fg", _local_time(p.started_at),
         p.command if isinstance(p.command, str) else " ".join(p.command))
        for p in found
    ]  # fmt: skip
    print_table(("PID", "TAG", "STATE", "KIND", "STARTED", "COMMAND"), rows, empty="no processes")


@process.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("ref")
@click.option("--no-replay", is_flag=True, help="Only output from now on, not what it kept.")
@_api_command
def attach(space: Space, sandbox_id: str, ref: str, no_replay: bool) -> int:
    """Follow process REF (pid or tag) until it ends; its exit status becomes ours. Ctrl-C
    leaves it running."""
    with _processes(space, sandbox_id).connect(_ref(ref), replay=not no_replay) as stream:
        try:
            print_output(stream)
        except KeyboardInterrupt:
            click.echo(f"space: left {ref} running", err=True)
            return 130
    return _status(stream.result)


@process.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("ref")
@click.option("--eof", is_flag=True, help="Close its stdin after this input.")
@_api_command
def stdin(space: Space, sandbox_id: str, ref: str, eof: bool) -> None:
    """Send our stdin (read to its end) to process REF, started with --keep-stdin."""
    _processes(space, sandbox_id).send_stdin(_ref(ref), sys.stdin.buffer.read(), eof=eof)


@process.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("ref")
@click.option(
    "--signal", "-s", "signum", default="KILL", callback=_signal, show_default=True,
    help="Signal name or number, sent to the process's group.",
)  # fmt: skip
@_api_command
def kill(space: Space, sandbox_id: str, ref: str, signum: int) -> None:
    """Signal process REF (pid or tag); KILL unless told otherwise."""
    processes = _processes(space, sandbox_id)
    if signum == signals.SIGKILL:
        processes.kill(_ref(ref))
    else:
        processes.signal(_ref(ref), signum)

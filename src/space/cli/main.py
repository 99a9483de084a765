"""The `space` command.

Its subcommands are imported only when used (see `lazy.py`): keep this module and the light
command modules (`sandbox`, `files`, `processes`, `checkpoints`, `pools`, `volumes`,
`completion`) free of imports beyond click and the standard library at their top.
"""

from __future__ import annotations

import click

from space import __version__
from space.cli import interrupt
from space.cli.lazy import LazyCommand, LazyGroup

COMMANDS = {
    # Through the HTTP API (the SDK)
    "sandbox": LazyCommand("space.cli.sandbox:sandbox", "Create, list and change sandboxes."),
    "exec": LazyCommand(
        "space.cli.sandbox:exec_", "Run a command in a sandbox, streaming its output."
    ),
    "shell": LazyCommand("space.cli.sandbox:shell", "Open an interactive terminal in a sandbox."),
    "process": LazyCommand(
        "space.cli.processes:process",
        "Background processes: list, follow, send input, signal, kill.",
    ),
    "cp": LazyCommand("space.cli.files:cp", "Copy a file into or out of a sandbox."),
    "watch": LazyCommand(
        "space.cli.files:watch", "Print what changes in directory PATH of a sandbox as it happens."
    ),
    "forward": LazyCommand(
        "space.cli.ports:forward", "Serve PORT of a sandbox on a local address."
    ),
    "link": LazyCommand(
        "space.cli.ports:link",
        "Print a link that opens PORT of a sandbox in a browser, without a key.",
    ),
    "checkpoint": LazyCommand(
        "space.cli.checkpoints:checkpoint",
        "Checkpoints: a sandbox's memory and disk at one moment, to roll back to, fork from or "
        "make a template of.",
    ),
    "fork": LazyCommand(
        "space.cli.checkpoints:fork",
        "Make running children of a sandbox (it runs on); prints their ids, one a line.",
    ),
    "mcp": LazyCommand(
        "space.cli.mcp:mcp",
        "Serve SPACE's sandboxes to MCP clients (stdio, or streamable HTTP with --http).",
    ),
    "secret": LazyCommand(
        "space.cli.secrets:secret",
        "Secrets: bind one to a sandbox's hosts with `space sandbox create --secret`.",
    ),
    "pool": LazyCommand(
        "space.cli.pools:pool",
        "Warm pools: sandboxes kept restored and ready, so creates of their shape take a claim.",
    ),
    "volume": LazyCommand(
        "space.cli.volumes:volume",
        "Volumes: mount one in a sandbox with `space sandbox create --volume ID:/path[:ro]`.",
    ),
    "audit": LazyCommand(
        "space.cli.audit:audit",
        "The control plane's audit log: who changed what, when, from where, how it ended.",
    ),
    "usage": LazyCommand(
        "space.cli.usage:usage",
        "What sandboxes and volumes were given and used: vCPU and RAM hours, CPU, storage, egress.",
    ),
    # On this host
    "template": LazyCommand(
        "space.cli.templates:template", "Build and list templates on this host."
    ),
    "image": LazyCommand(
        "space.cli.images:image",
        "Build the guest kernel and template images (cached; --force rebuilds).",
    ),
    "vm": LazyCommand(
        "space.cli.vm:vm", "Boot and drive single microVMs on this host (debugging)."
    ),
    "doctor": LazyCommand(
        "space.cli.doctor:doctor",
        "Check that this host can run SPACE: KVM, devices, storage, network, tools.",
    ),
    # The platform's services, and its operators
    "up": LazyCommand(
        "space.cli.services:up",
        "Bring the whole platform up on this machine and print how to use it.",
    ),
    "api": LazyCommand("space.cli.services:api", "Run the HTTP API server."),
    "controller": LazyCommand(
        "space.cli.services:controller",
        "Run a controller replica (one leads; the others stand by).",
    ),
    "worker": LazyCommand("space.cli.services:worker", "Run the worker service of this host."),
    "admin": LazyCommand(
        "space.cli.admin:admin",
        "Tenants and API keys (operators only: this talks to the database directly).",
    ),
    "completion": LazyCommand(
        "space.cli.completion:completion",
        "Print the shell completion script for bash, zsh or fish.",
    ),
}


# Ctrl-C (space.cli.interrupt): services stop on their own signals, draining what they serve;
# commands on this host keep Python's and asyncio's own handling (a cancelled task stops its VMs
# and processes, and that clean-up is waited for), and a status of 130.
SERVICES = frozenset({"up", "api", "controller", "worker", "mcp"})
ON_THIS_HOST = frozenset({"template", "image", "vm", "doctor", "admin"})


class Commands(LazyGroup):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            ctx.exit(interrupt.STATUS)  # interrupted, not an error: no "Aborted!"


@click.group(cls=Commands, lazy=COMMANDS)
@click.version_option(__version__, prog_name="space")
@click.option("-v", "--verbose", is_flag=True, help="Log what happens underneath.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """SPACE: sandboxed microVMs for agents."""
    import logging

    if ctx.invoked_subcommand not in SERVICES | ON_THIS_HOST:
        interrupt.stop_at_ctrl_c()
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


def main() -> None:
    cli(prog_name="space")


if __name__ == "__main__":
    main()

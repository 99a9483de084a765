"""Shell completion: `space completion bash|zsh|fish` prints the script (click's own, driven by
`_SPACE_COMPLETE`), and sandbox id arguments complete from the API."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

SHELLS = ("bash", "zsh", "fish")
COMPLETION_VARIABLE = "_SPACE_COMPLETE"
# One page of the listing, answered quickly or not at all: a completion must never hang a shell.
COMPLETE_AT_MOST = 100
COMPLETE_TIMEOUT_S = 2.0


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
def completion(shell: str) -> None:
    """Print the shell completion script for bash, zsh or fish.

    \b
    bash:  eval "$(space completion bash)"    (in ~/.bashrc)
    zsh:   eval "$(space completion zsh)"     (in ~/.zshrc)
    fish:  space completion fish > ~/.config/fish/completions/space.fish

    Sandbox ids complete too, from the API the CLI would use (SPACE_API_URL, the credentials
    file).
    """
    from click.shell_completion import get_completion_class

    kind = get_completion_class(shell)
    assert kind is not None, shell  # every name in SHELLS is one of click's
    root = click.get_current_context().find_root().command
    click.echo(kind(root, {}, "space", COMPLETION_VARIABLE).source())


def complete_sandbox_ids(
    ctx: click.Context, _param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """The ids of the newest sandboxes that start with `incomplete`, with their state; none
    when the API cannot answer in time."""
    from click.shell_completion import CompletionItem

    from space.client import Sandbox, Space, SpaceError

    try:
        with Space(
            ctx.params.get("api_url"), ctx.params.get("api_key"), timeout=COMPLETE_TIMEOUT_S
        ) as space:
            newest = itertools.islice(Sandbox.list(client=space), COMPLETE_AT_MOST)
            return [
                CompletionItem(sb.id, help=sb.state)
                for sb in newest
                if sb.id.startswith(incomplete)
            ]
    except SpaceError:
        return []

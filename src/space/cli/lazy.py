"""A click group whose commands are imported only when one of them runs.

`space --help` and `space exec` must start at once, and the commands' modules bring in very
different worlds (the HTTP SDK, the VM runtime, the database). So the group knows each command
by name, where it lives and its one-line summary; the help list and shell completion of command
names are made from that, and a module is imported only to run (or show the help of) its
command. `tests/cli/test_startup.py` checks that every summary matches its command.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem


@dataclass(frozen=True)
class LazyCommand:
    target: str  # "package.module:attribute"
    summary: str  # the command's short help, shown without importing it

    def load(self) -> click.Command:
        module, _, attribute = self.target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.target} is not a click command")
        return command


class LazyGroup(click.Group):
    def __init__(self, *args: Any, lazy: Mapping[str, LazyCommand], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.add_command(self.lazy[cmd_name].load(), cmd_name)
        return self.commands.get(cmd_name)

    def _summary(self, name: str, limit: int) -> str:
        if name in self.commands:
            return self.commands[name].get_short_help_str(limit)
        return click.Command(name, help=self.lazy[name].summary).get_short_help_str(limit)

    def _visible(self, ctx: click.Context) -> list[str]:
        return [
            name
            for name in self.list_commands(ctx)
            if name in self.lazy or not self.commands[name].hidden
        ]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self._visible(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(map(len, names))
        with formatter.section("Commands"):
            formatter.write_dl([(name, self._summary(name, limit)) for name in names])

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        from click.shell_completion import CompletionItem

        items = [
            CompletionItem(name, help=self._summary(name, 45))
            for name in self._visible(ctx)
            if name.startswith(incomplete)
        ]
        # Options of the group itself (--verbose, ...), as click's own Group adds them.
        return items + click.Command.shell_complete(self, ctx, incomplete)

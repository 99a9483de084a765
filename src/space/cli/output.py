"""How the CLI prints what it lists: an aligned table for people, or JSON (`--json`) for programs.

JSON documents are the API's own objects (the SDK's dataclasses, field for field; times in
ISO 8601 with their offset), so their keys are as stable as the API's; `docs/cli.md` lists them.
Tables are plain aligned columns: a listing is the command people and scripts run most, and
rich's table costs more to import (~25 ms) than the rest of such a command's own work.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def json_option(fn: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON instead of a table (docs/cli.md)."
    )(fn)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot print a {type(value).__name__} as JSON")


def print_json(value: Any) -> None:
    """`value` (dataclasses, lists and dicts of them) as an indented JSON document."""
    click.echo(json.dumps(value, indent=2, default=_plain, ensure_ascii=False))


def print_table(
    headers: Sequence[str], rows: Iterable[Sequence[str]], *, empty: str | None = None
) -> None:
    """Columns padded to their widest cell, one line per row however wide (for grep and awk);
    the header is bold on a terminal. With no rows, `empty` goes to stderr instead."""
    lines = [list(headers), *map(list, rows)]
    if len(lines) == 1 and empty is not None:
        click.echo(empty, err=True)
        return
    widths = [max(len(line[i]) for line in lines) for i in range(len(headers))]
    for n, line in enumerate(lines):
        text = "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True))
        click.echo(click.style(text.rstrip(), bold=n == 0))  # styles vanish when piped

"""The doctor's answer for people (a coloured list; rich is imported only here) and for
programs (one JSON document)."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from space.doctor.model import STATUSES, Check, Status, worst

MARKS = {"ok": ("✔", "green"), "warn": ("!", "yellow"), "fail": ("✘", "red")}
VERDICTS = {
    "ok": "SPACE can run here.",
    "warn": "SPACE can run here, degraded: see the warnings.",
    "fail": "SPACE cannot run here until the failures are fixed.",
}


def document(checks: list[Check]) -> dict[str, Any]:
    """{"host", "status" (the worst), "counts", "checks": [{id, status, summary, detail, fix}]}"""
    counts = {status: sum(c.status == status for c in checks) for status in MARKS}
    return {
        "host": os.uname().nodename,
        "status": worst(checks),
        "counts": counts,
        "checks": [c.to_json() for c in checks],
    }


def verdict(checks: list[Check]) -> str:
    counts = document(checks)["counts"]
    return (f"{counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failures. "
            + VERDICTS[worst(checks)])  # fmt: skip


def render(
    checks: list[Check], *, show: Collection[Status] = STATUSES, stderr: bool = False
) -> None:
    """Print each check whose status is in `show`, with what a problem means and its fix under
    it, then the verdict."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(stderr=stderr, highlight=False)
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, style="bold")
    table.add_column(overflow="fold")
    for check in checks:
        if check.status not in show:
            continue
        mark, colour = MARKS[check.status]
        text = Text(check.summary)
        if check.detail:
            text.append("\n" + check.detail, style="dim")
        if check.fix:
            text.append("\nfix: ", style=f"bold {colour}").append(check.fix)
        table.add_row(Text(f"{mark} {check.status:4}", style=f"bold {colour}"), check.id, text)
    if table.row_count:
        console.print(table)
    console.print(Text(verdict(checks), style=f"bold {MARKS[worst(checks)][1]}"))

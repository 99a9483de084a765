"""`space audit`: the control plane's audit log through the HTTP API (a tenant's key reads its
own entries, an admin key everyone's); `--jsonl` exports every entry that matches, page by page."""

from __future__ import annotations

import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

import click

from space.cli.output import print_table
from space.cli.sandbox import _api_command, _local_time

if TYPE_CHECKING:
    from space.client import AuditRecord, Space

PAGE = 500


@click.command()
@click.option("--since", type=click.DateTime(), help="Entries from this time (local).")
@click.option("--until", type=click.DateTime(), help="Entries before this time (local).")
@click.option("--tenant", help="One tenant's entries (an admin key's question).")
@click.option("--key", help="Calls made with this key id.")
@click.option("--subject", help="Calls that named or made this id (a sandbox, a key...).")
@click.option("--action", help='Calls whose route holds this, e.g. "/pause" or "DELETE".')
@click.option("--after", type=click.IntRange(0), default=0, help="Entries after this id.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True,
              help="Entries in the table.")  # fmt: skip
@click.option("--jsonl", is_flag=True, help="Every entry that matches, one JSON object a line.")
@_api_command
def audit(space: Space, after: int, limit: int, jsonl: bool, **filters: Any) -> None:
    """The control plane's audit log: who changed what, when, from where, how it ended.

    Oldest first; a tenant's key reads its own tenant's entries, an admin key everyone's."""
    for name in ("since", "until"):
        if isinstance(filters[name], datetime):
            filters[name] = filters[name].astimezone()  # click reads a naive, local time
    if not jsonl:
        entries = space.audit_log(after, limit, **filters)
        print_table(
            ("ID", "AT", "TENANT", "KEY", "ACTION", "SUBJECT", "STATUS"),
            [_row(e) for e in entries],
            empty="no entries",
        )
        return
    while entries := space.audit_log(after, PAGE, **filters):
        for e in entries:
            click.echo(json.dumps(_document(e), ensure_ascii=False))
        after = entries[-1].id


def _row(e: AuditRecord) -> tuple[str, ...]:
    subject = e.created or next(reversed(e.params.values()), "")
    return (str(e.id), _local_time(e.at), e.tenant_id or "-", e.key_id or "-", e.action,
            subject or "-", f"{e.status} {e.outcome}")  # fmt: skip


def _document(e: AuditRecord) -> dict[str, Any]:
    return {**e.__dict__, "at": e.at.isoformat()}

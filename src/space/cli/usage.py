"""`space usage`: what sandboxes and volumes were given and used (metering), through the HTTP API:
totals per group, or a line per step with `--points`; `--hosts` the hosts their gateways sent
most to. A tenant's key reads its own usage, an admin key everyone's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click

from space.cli.output import print_table
from space.cli.sandbox import _api_command

if TYPE_CHECKING:
    from space.client import Space

AGO = re.compile(r"^([0-9]+)([smhd])$")
UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# The columns of the table: a figure each, shown in the unit people bill in.
COLUMNS: tuple[tuple[str, Callable[[dict[str, float]], float]], ...] = (
    ("vCPU-h run", lambda f: f.get("vcpu_seconds_running", 0) / 3600),
    ("vCPU-h paused", lambda f: f.get("vcpu_seconds_paused", 0) / 3600),
    ("GiB-h RAM", lambda f: (f.get("memory_gib_seconds_running", 0)
                             + f.get("memory_gib_seconds_paused", 0)) / 3600),
    ("CPU-h used", lambda f: f.get("cpu_seconds", 0) / 3600),
    ("disk GiB-h", lambda f: f.get("disk_gib_hours", 0)),
    ("stored GiB-h", lambda f: f.get("snapshot_gib_hours", 0) + f.get("checkpoint_gib_hours", 0)
     + f.get("volume_gib_hours", 0)),
    ("egress MB", lambda f: f.get("egress_bytes", 0) / 1e6),
)  # fmt: skip


class When(click.ParamType):  # type: ignore[type-arg]
    """A time: ISO 8601 (a local time without a zone), or how long ago ("90m", "7d")."""

    name = "when"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, datetime):
            return value
        m = AGO.match(str(value).strip())
        if m is not None:
            return datetime.now(UTC) - timedelta(**{UNITS[m.group(2)]: int(m.group(1))})
        try:
            return datetime.fromisoformat(str(value)).astimezone()
        except ValueError:
            self.fail(f"{value!r} is neither a time (2026-12-01T09:00) nor an age (7d)", param, ctx)


@click.command()
@click.option(
    "--since", type=When(), help='From this time, or this long ago ("7d"); default a day ago.'
)
@click.option("--until", type=When(), help="Until this time (default now).")
@click.option(
    "--step", default="1h", show_default=True, help='A point per step: "60s", "1h", "1d".'
)
@click.option(
    "--by",
    default="total",
    show_default=True,
    help='total, tenant (admins), sandbox, template or "label:KEY".',
)
@click.option("--tenant", help="One tenant's usage (an admin key's question).")
@click.option("--sandbox", help="One sandbox's usage.")
@click.option("--template", help="Sandboxes of this template.")
@click.option("--label", help='Sandboxes whose metadata has "KEY=VALUE".')
@click.option("--points", is_flag=True, help="A line per step, not a total per group.")
@click.option("--hosts", is_flag=True, help="The hosts the gateways sent most to, instead.")
@click.option("--json", "as_json", is_flag=True, help="The API's answer as it is.")
@_api_command
def usage(space: Space, step: str, by: str, points: bool, hosts: bool, as_json: bool,
          **filters: Any) -> None:  # fmt: skip
    """What sandboxes and volumes were given and used: vCPU and RAM hours, CPU, storage, egress.

    Given: vCPUs and RAM by the hour, running or paused. Used: the host's CPU time, storage and
    egress, measured on the hosts (metering)."""
    filters = {k: v for k, v in filters.items() if v is not None}
    if hosts:
        found = space.usage_hosts(**filters)
        if as_json:
            click.echo(json.dumps([h.__dict__ for h in found], indent=2))
            return
        print_table(("HOST", "SENT MB", "RECEIVED MB"),
                    [(h.host, f"{h.sent_bytes / 1e6:.3f}", f"{h.received_bytes / 1e6:.3f}")
                     for h in found], empty="no traffic in the range")  # fmt: skip
        return
    answer = space.usage(step, by, **filters)
    if as_json:
        click.echo(json.dumps(_document(answer), indent=2))
        return
    heads = ("AT" if points else by.upper().partition(":")[0], *(c[0] for c in COLUMNS))
    rows = []
    for series in answer.series:
        if points:
            for at, figures in series.points:
                label = at.astimezone().strftime("%Y-%m-%d %H:%M")
                rows.append(_row(f"{series.key} {label}" if series.key else label, figures))
        else:
            rows.append(_row(series.key or "-", series.total))
    if len(answer.series) > 1 or points:
        rows.append(_row("total", answer.total))
    print_table(heads, rows, empty="no usage in the range")


def _row(name: str, figures: dict[str, float]) -> tuple[str, ...]:
    return (name, *(f"{column(figures):.3f}" for _, column in COLUMNS))


def _document(answer: Any) -> dict[str, Any]:
    return {
        "since": answer.since.isoformat(), "until": answer.until.isoformat(),
        "step_s": answer.step_s, "by": answer.by, "total": answer.total,
        "series": [{"key": s.key, "total": s.total,
                    "points": [{"at": at.isoformat(), **f} for at, f in s.points]}
                   for s in answer.series],
    }  # fmt: skip

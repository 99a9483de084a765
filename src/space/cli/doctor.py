"""`space doctor`: what this host needs for SPACE, checked (the checks are `space.doctor`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from space.cli.output import print_json

if TYPE_CHECKING:
    from click.shell_completion import CompletionItem

    from space.doctor import Status

PROBLEMS: tuple[Status, ...] = ("warn", "fail")
FAILURES: tuple[Status, ...] = ("fail",)


def _check_ids(
    _ctx: click.Context, _param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    from click.shell_completion import CompletionItem

    from space.doctor import CHECKS

    return [CompletionItem(name) for name in CHECKS if name.startswith(incomplete)]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document (docs/cli.md).")
@click.option(
    "--only",
    multiple=True,
    metavar="ID",
    shell_complete=_check_ids,
    help="Run only the check ID (as listed). Repeatable.",
)
@click.option("--problems", is_flag=True, help="Show only warnings and failures.")
def doctor(as_json: bool, only: tuple[str, ...], problems: bool) -> None:
    """Check that this host can run SPACE: KVM, devices, storage, network, tools.

    Each need is tried where it can be (a KVM probe boot, a loop device attached, a file
    cloned in the pool, the worker's nftables rules loaded in a throwaway namespace) and found
    ok, warn (SPACE works, degraded) or fail (it cannot), with what that means and the fix.
    Exits 1 when anything fails.
    """
    from space.doctor import run_checks, worst
    from space.settings import SettingsError

    try:
        checks = run_checks(only=only)
    except SettingsError as e:
        raise click.ClickException(str(e)) from None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--only") from None
    if as_json:
        from space.doctor.report import document

        print_json(document(checks))
    else:
        from space.doctor.report import render

        if problems:
            render(checks, show=PROBLEMS)
        else:
            render(checks)
    if worst(checks) == "fail":
        click.get_current_context().exit(1)


def require_healthy_host() -> None:
    """For `space up`: stop on what cannot work, showing why; name the warnings in a line."""
    from space.doctor import run_checks, worst
    from space.doctor.report import render

    checks = run_checks()
    if worst(checks) == "fail":
        render(checks, show=FAILURES, stderr=True)
        raise click.ClickException("this host cannot run SPACE yet: fix the failures above")
    warnings = [c.id for c in checks if c.status == "warn"]
    if warnings:
        click.secho(f"space up: the host works, degraded ({', '.join(warnings)}): "
                    "`space doctor` says why", fg="yellow", err=True)  # fmt: skip

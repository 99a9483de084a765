"""`space template ...`: build templates from a spec file (space.toml) on this host, list them.

The build runs here, with this host's VM runtime (pool, guest kernel, QEMU): the same builder the
worker runs for the API. Its log streams to the terminal under a progress bar over the steps.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from space.worker.agent_client import AgentError
from space.worker.images.debs import ImageBuildError
from space.worker.local import local_runtime
from space.worker.storage.pool import ensure_pool
from space.worker.templates import (
    BuildEnv,
    TemplateError,
    TemplateRecord,
    build_template,
    list_templates,
    load_spec,
    prune_cache,
    remove_template,
)
from space.worker.vmm.base import VMMError

_console = Console(highlight=False)
_STEP = re.compile(r"^step (\d+): (cached|done in)")


@click.group()
def template() -> None:
    """Build and list templates on this host."""


@template.command("build")
@click.option(
    "-f",
    "--file",
    "spec_path",
    type=click.Path(path_type=Path, exists=True),
    default=Path("space.toml"),
    show_default=True,
    help="The template spec (a directory means its space.toml).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    help="Root for templates/ and the step cache (default: the worker's pool; keep it on the "
    "pool's file system so that clones are reflinks).",
)
def build(spec_path: Path, out: Path | None) -> None:
    """Build the template a spec file describes; cached steps are reused."""
    try:
        record = asyncio.run(_build(spec_path, out))
    except (TemplateError, ImageBuildError, AgentError, VMMError, OSError) as e:
        raise click.ClickException(str(e)) from None
    _console.print(f"[bold green]built[/] {record.name} {record.digest}  {record.path}")
    if record.command:
        _console.print(f"  command: {' '.join(record.command)}")


async def _build(spec_path: Path, out: Path | None) -> TemplateRecord:
    spec = load_spec(spec_path)
    started = time.monotonic()
    stages = len(spec.steps) + 1  # the source, then each step
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=_console,
        transient=True,
    ) as progress:
        task = progress.add_task(f"{spec.name}: preparing", total=stages)

        def log(line: str) -> None:
            progress.console.print(
                f"[dim]{time.monotonic() - started:6.1f}s[/dim] "
                + (f"[dim]{escape(line)}[/dim]" if line.startswith("  ") else escape(line))
            )
            if line.startswith("source: cached") or line.startswith("mkfs.ext4"):
                progress.update(task, completed=1, description=f"{spec.name}: steps")
            elif m := _STEP.match(line):
                progress.update(task, completed=int(m.group(1)) + 1)
            elif line.startswith("step "):
                progress.update(task, description=f"{spec.name}: {escape(line[:60])}")

        rt = await local_runtime(log=log)
        env = BuildEnv.from_runtime(rt, out)
        record = await build_template(spec, env, log)
        progress.update(task, completed=stages)
    return record


@template.command("ls")
@click.option(
    "--root",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where the templates were built (default: the worker's pool).",
)
def list_(root: Path | None) -> None:
    """List the templates built on this host."""
    root = root or ensure_pool().root
    records = list_templates(root)
    if not records:
        _console.print(f"no templates under {root / 'templates'}")
        return
    table = Table(box=None, pad_edge=False)
    for col in ("NAME", "DIGEST", "SIZE", "BUILT"):
        table.add_column(col, no_wrap=True)
    for col in ("SOURCE", "COMMAND"):
        table.add_column(col, overflow="fold")
    for r in records:
        table.add_row(
            r.name,
            r.digest,
            f"{r.size_bytes >> 20} MiB",
            r.built_at,
            escape(r.source),
            escape(" ".join(r.command) or r.start or ""),
        )
    _console.print(table)


@template.command("rm")
@click.argument("name")
@click.option("--digest", help="Only this build (default: every build of NAME).")
@click.option("--root", type=click.Path(path_type=Path, file_okay=False))
def remove(name: str, digest: str | None, root: Path | None) -> None:
    """Delete a built template (sandboxes made from it keep their disks)."""
    removed = remove_template(root or ensure_pool().root, name, digest)
    if not removed:
        raise click.ClickException(f"no template {name}" + (f" {digest}" if digest else ""))
    for r in removed:
        _console.print(f"removed {r.name} {r.digest}")


@template.command("prune")
@click.option(
    "--older-than", "hours", type=float, default=24.0, show_default=True,
    help="Remove step cache entries unused for this many hours.",
)  # fmt: skip
@click.option("--root", type=click.Path(path_type=Path, file_okay=False))
def prune(hours: float, root: Path | None) -> None:
    """Free the disk space of old build steps (later rebuilds redo them)."""
    count, freed = prune_cache(root or ensure_pool().root, hours * 3600)
    # Blocks that templates share with the entries (reflinks) stay allocated.
    _console.print(f"removed {count} cache entries ({freed / 1e6:.0f} MB of images, shared or not)")

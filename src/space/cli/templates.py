"""`space template ...`: build templates from a spec file (space.toml) or a Dockerfile, list
them.

`build` asks the platform's API (a worker builds it, the log streams back), or with `--local`
runs the same builder here, with this host's VM runtime. Either way the log streams to the
terminal under a progress bar over the steps. `ls`, `rm` and `prune` look at this host's pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from space.cli.output import json_option, print_json
from space.client import AsyncSpace, SpaceError
from space.client._config import KEY_VARIABLE, URL_VARIABLE
from space.settings import Settings
from space.worker.agent_client import AgentError
from space.worker.images.debs import ImageBuildError
from space.worker.local import local_runtime
from space.worker.storage.pool import ensure_pool
from space.worker.templates import (
    BuildEnv,
    TemplateError,
    TemplateRecord,
    TemplateSpec,
    build_template,
    list_templates,
    load_spec,
    prune_cache,
    remove_template,
)
from space.worker.templates.dockerfile import dockerfile_spec
from space.worker.templates.spec import SPEC_FILE, parse_spec
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
    help="The template spec (a directory means its space.toml), or a Dockerfile.",
)
@click.option("--name", help="With a Dockerfile: the template's name.")
@click.option(
    "--context",
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="With a Dockerfile: its build context (default: the Dockerfile's directory).",
)
@click.option(
    "--build-arg", "build_args", multiple=True, metavar="NAME=VALUE",
    help="With a Dockerfile: the value of one of its ARGs (repeatable).",
)  # fmt: skip
@click.option(
    "--insecure", is_flag=True,
    help="With a Dockerfile: its FROM registry speaks plain HTTP (local hosts only).",
)  # fmt: skip
@click.option("--local", is_flag=True, help="Build on this host, not through the API.")
@click.option(
    "--out",
    type=click.Path(path_type=Path, file_okay=False),
    help="With --local: root for templates/ and the step cache (default: the worker's pool; keep "
    "it on the pool's file system so that clones are reflinks).",
)
@click.option("--api-url", envvar=URL_VARIABLE, help="API address (as for `space sandbox`).")
@click.option("--api-key", envvar=KEY_VARIABLE, help="An admin API key.")
def build(
    spec_path: Path,
    name: str | None,
    context: Path | None,
    build_args: tuple[str, ...],
    insecure: bool,
    local: bool,
    out: Path | None,
    api_url: str | None,
    api_key: str | None,
) -> None:
    """Build the template a spec file or a Dockerfile describes; cached steps are reused."""
    try:
        source = _Source.of(spec_path, name, context, build_args, insecure)
        if not local:
            asyncio.run(_build_remote(source, api_url, api_key))
            return
        record = asyncio.run(_build(source.spec, out))
    except (TemplateError, ImageBuildError, AgentError, VMMError, OSError, SpaceError) as e:
        raise click.ClickException(str(e)) from None
    _console.print(f"[bold green]built[/] {record.name} {record.digest}  {record.path}")
    if record.command:
        _console.print(f"  command: {' '.join(record.command)}")


@dataclass(frozen=True)
class _Source:
    """What `build` was given: a spec file, or a Dockerfile with its context and arguments
    (and the spec it becomes, checked here before anything is uploaded)."""

    path: Path
    spec: TemplateSpec
    dockerfile: bool = False
    context: Path | None = None
    build_args: dict[str, str] = field(default_factory=dict)
    insecure: bool = False

    @classmethod
    def of(
        cls,
        path: Path,
        name: str | None,
        context: Path | None,
        build_args: tuple[str, ...],
        insecure: bool,
    ) -> _Source:
        if not _is_dockerfile(path):
            if name or context or build_args or insecure:
                raise click.UsageError(
                    "--name, --context, --build-arg and --insecure go with a Dockerfile"
                )
            return cls(path / SPEC_FILE if path.is_dir() else path, load_spec(path))
        if not name:
            raise click.UsageError("a Dockerfile build needs the template's --name")
        args = dict(_build_arg(a) for a in build_args)
        context = (context or path.parent).resolve()
        text = dockerfile_spec(path.read_text(), name, args, insecure=insecure)
        spec = parse_spec(text, context, where=f"{path} (as a template spec)")
        return cls(path, spec, True, context, args, insecure)


def _is_dockerfile(path: Path) -> bool:
    name = path.name.lower()
    return path.is_file() and (
        name in ("dockerfile", "containerfile")
        or name.startswith("dockerfile.")
        or name.endswith(".dockerfile")
    )


def _build_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{text!r} is not NAME=VALUE", param_hint="--build-arg")
    return key, value


@contextlib.contextmanager
def _progress(spec: TemplateSpec) -> Iterator[Callable[[str], None]]:
    """A log sink that prints each line and moves a progress bar over the build's stages."""
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

        yield log
        progress.update(task, completed=stages)


async def _build(spec: TemplateSpec, out: Path | None) -> TemplateRecord:
    with _progress(spec) as log:
        rt = await local_runtime(Settings.from_env().worker, log=log)
        env = BuildEnv.from_runtime(rt, out)
        return await build_template(spec, env, log)


async def _build_remote(source: _Source, api_url: str | None, api_key: str | None) -> None:
    """Through the API: the spec's directory (a Dockerfile's context) goes along as the build
    context, and the values of the credential variables a spec names are read from this
    environment."""
    spec = source.spec
    async with AsyncSpace(api_url, api_key) as space:
        if source.dockerfile:
            await space.build_from_dockerfile(spec.name, source.path, source.context,
                                              source.build_args, source.insecure)  # fmt: skip
        else:
            names = [n for n in (spec.username_env, spec.password_env) if n]
            environ = {n: os.environ[n] for n in names if n in os.environ}
            await space.build_template(spec.name, source.path, environ)
        with _progress(spec) as log:
            async for line in space.build_log(spec.name):
                log(line)
        # The log ends with the build; its outcome reaches the API a moment later.
        tpl = await space.template(spec.name)
        for _ in range(150):
            if tpl.state != "building":
                break
            await asyncio.sleep(0.2)
            tpl = await space.template(spec.name)
    if tpl.state != "ready":
        raise click.ClickException(f"template {spec.name}: {tpl.state}: {tpl.error}")
    built = tpl.built or {}
    _console.print(f"[bold green]built[/] {spec.name} {built.get('digest')}")


@template.command("ls")
@click.option(
    "--root",
    type=click.Path(path_type=Path, file_okay=False),
    help="Where the templates were built (default: the worker's pool).",
)
@json_option
def list_(root: Path | None, as_json: bool) -> None:
    """List the templates built on this host."""
    root = root or ensure_pool().root
    records = list_templates(root)
    if as_json:
        print_json([{**r.to_json(), "path": r.path} for r in records])
        return
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

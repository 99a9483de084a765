"""`space cp` and `space watch`: a sandbox's files through the HTTP API."""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import click

from space.cli.completion import complete_sandbox_ids
from space.cli.sandbox import _api_command

if TYPE_CHECKING:
    from space.client import Sandbox, Space

PROGRESS_FROM = 1 << 20  # files up to 1 MiB copy too fast for a progress bar to help
# ID:/absolute/path names a file in a sandbox; anything else is a local path.
REMOTE_PATH = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>/.*)$")


@click.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("path")
@click.option("--recursive", "-r", is_flag=True, help="Also what changes under its subdirectories.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object a line: type, path, is_dir.")
@_api_command
def watch(space: Space, sandbox_id: str, path: str, recursive: bool, as_json: bool) -> None:
    """Print what changes in directory PATH of a sandbox as it happens. It ends at Ctrl-C or
    when the directory goes."""
    from space.client import Sandbox

    sb = Sandbox.get(sandbox_id, client=space)
    with sb.files.watch(path, recursive=recursive) as events:
        click.echo(f"watching {sb.id}:{path}", err=True)
        try:
            for event in events:
                if as_json:
                    click.echo(json.dumps({"type": event.type, "path": event.path,
                                           "is_dir": event.is_dir}))  # fmt: skip
                else:
                    slash = "/" if event.is_dir else ""
                    click.echo(f"{event.type:<8} {event.path or '-'}{slash}")
        except KeyboardInterrupt:
            return
    if events.ended:
        click.echo(f"{path} was {events.ended}", err=True)


@click.command()
@click.argument("src")
@click.argument("dst")
@_api_command
def cp(space: Space, src: str, dst: str) -> None:
    """Copy a file into or out of a sandbox.

    One of SRC and DST is ID:/absolute/path, the other a local path; a DST that is a directory
    receives the file under its own name.
    """
    from space.client import Sandbox

    source, target = REMOTE_PATH.match(src), REMOTE_PATH.match(dst)
    if (source is None) == (target is None):
        raise click.UsageError("exactly one of SRC and DST must be a sandbox path, ID:/abs/path")
    if source is not None:
        sb = Sandbox.get(source["id"], client=space)
        _download(sb, source["path"], Path(dst))
    elif target is not None:
        sb = Sandbox.get(target["id"], client=space)
        _upload(sb, Path(src), target["path"])


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A callback taking bytes moved; behind it, a progress bar for big files."""
    if total <= PROGRESS_FROM:
        yield lambda _: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def _download(sb: Sandbox, path: str, dst: Path) -> None:
    entry = sb.files.stat(path)
    if entry.is_dir:
        raise click.ClickException(f"{sb.id}:{path} is a directory; cp copies one file")
    if dst.is_dir():
        dst /= entry.name
    # Into a temporary file first, so a failed copy leaves nothing half-written behind.
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    try:
        with os.fdopen(fd, "wb") as f, _progress(entry.size, dst.name) as advance:
            for chunk in sb.files.iter(path):
                f.write(chunk)
                advance(len(chunk))
        os.chmod(tmp, entry.mode & 0o777)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


def _upload(sb: Sandbox, src: Path, path: str) -> None:
    if src.is_dir():
        raise click.ClickException(f"{src} is a directory; cp copies one file")
    from space.client import NotFoundError

    if path.endswith("/"):
        path += src.name
    else:
        with contextlib.suppress(NotFoundError):
            if (sb.files.stat(path)).is_dir:
                path = f"{path}/{src.name}"
    with src.open("rb") as f, _progress(src.stat().st_size, src.name) as advance:
        mode = os.fstat(f.fileno()).st_mode & 0o777
        sb.files.write(path, _counted(f, advance), mode=mode)


def _counted(f: BinaryIO, advance: Callable[[int], None]) -> Iterator[bytes]:
    from space.client._calls import read_chunks

    for chunk in read_chunks(f):
        advance(len(chunk))
        yield chunk

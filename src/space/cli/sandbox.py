"""`space sandbox ...`, `space exec`, `space shell`, `space cp`: sandboxes through the HTTP API.

These commands are a client like any other: they use the SDK. The API's address and key come
from --api-url/--api-key, then SPACE_API_URL/SPACE_API_KEY, then the credentials file that
`space up` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO, Concatenate, Literal

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from space.client import (
    AsyncSandbox,
    AsyncSpace,
    ExecResult,
    NotFoundError,
    SandboxInfo,
    SpaceError,
)
from space.client._calls import read_chunks
from space.client._config import DEFAULT_API_URL, KEY_VARIABLE, URL_VARIABLE

PROGRESS_FROM = 1 << 20  # files up to 1 MiB copy too fast for a progress bar to help
# ID:/absolute/path names a file in a sandbox; anything else is a local path.
REMOTE_PATH = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_.-]*):(?P<path>/.*)$")

Body = Callable[Concatenate[AsyncSpace, ...], Coroutine[Any, Any, int | None]]


def _api_command(body: Body) -> Callable[..., None]:
    """A command body as a coroutine taking an open AsyncSpace; adds --api-url and --api-key.

    SDK errors become one clear line, not a traceback; a returned int is the exit status.
    """

    @click.option(
        "--api-url",
        envvar=URL_VARIABLE,
        help=f"API address  [default: ${URL_VARIABLE}, then the credentials file, then "
        f"{DEFAULT_API_URL}]",
    )
    @click.option(
        "--api-key",
        envvar=KEY_VARIABLE,
        help=f"API key  [default: ${KEY_VARIABLE}, then the credentials file]",
    )
    @functools.wraps(body)
    def command(api_url: str | None, api_key: str | None, **kwargs: Any) -> None:
        async def run() -> int | None:
            async with AsyncSpace(api_url, api_key) as space:
                return await body(space, **kwargs)

        try:
            status = asyncio.run(run())
        except SpaceError as e:
            raise click.ClickException(str(e)) from None
        if status is not None:
            click.get_current_context().exit(status)

    return command


def _pairs(_ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    """`--opt KEY=VALUE`, repeatable, as a dict."""
    pairs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param=param)
        pairs[key] = value
    return pairs


def _pairs_option(*names: str, help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(*names, multiple=True, callback=_pairs, metavar="KEY=VALUE", help=help)


_env_option = _pairs_option("--env", "-e", help="Environment variable. Repeatable.")


def _volume(param: click.Parameter, value: str) -> dict[str, Any]:
    """`ID:/path` or `ID:/path:ro` as an attachment."""
    vid, sep, rest = value.partition(":")
    path, _, mode = rest.partition(":")
    if not sep or not vid or not path.startswith("/") or mode not in ("", "ro", "rw"):
        raise click.BadParameter(f"{value!r} is not ID:/PATH or ID:/PATH:ro", param=param)
    return {"volume": vid, "path": path, "read_only": mode == "ro"}


def _exec_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What `exec` and `shell` share: the command's environment, directory and user."""
    fn = click.option("--user", "-u", help="Run as this user.")(fn)
    fn = click.option("--cwd", help="Working directory (absolute).")(fn)
    return _env_option(fn)


def _status(result: ExecResult) -> int:
    """A shell's exit status for the command: its exit code, or 128 + the signal that ended it."""
    if result.exit_code is not None:
        return result.exit_code
    return 128 + (result.signal or 0)


def _local_time(at: datetime | None) -> str:
    return at.astimezone().strftime("%Y-%m-%d %H:%M") if at else "-"


# space sandbox ...


@click.group()
def sandbox() -> None:
    """Create, list and change sandboxes."""


@sandbox.command()
@click.option("--template", help="Template to start from  [server default: base]")
@click.option("--vcpus", type=click.IntRange(1), help="Virtual CPUs  [server default: 1]")
@click.option("--memory", type=click.IntRange(1), help="Memory in MiB  [server default: 256]")
@click.option("--disk", type=click.IntRange(1), help="Disk in MiB  [server default: 1024]")
@click.option(
    "--timeout",
    type=click.IntRange(1),
    help="Seconds until the timeout action  [server default: 300]",
)
@click.option(
    "--timeout-action",
    type=click.Choice(["pause", "suspend", "delete"]),
    help="What happens at the timeout  [server default: pause]",
)
@_env_option
@_pairs_option("--metadata", "-m", help="Label to find it by (ls --metadata). Repeatable.")
@click.option("--id", "sandbox_id", help="Choose the id (creating it again answers the same one).")
@click.option(
    "--volume",
    "volumes",
    multiple=True,
    callback=lambda _c, p, vs: [_volume(p, v) for v in vs],
    metavar="ID:/PATH[:ro]",
    help="Mount a volume (read-only with :ro). Repeatable, at most 2.",
)
@click.option(
    "--allow",
    multiple=True,
    metavar="HOST",
    help="Let it reach this name (or *.domain) on ports 80/443. Repeatable. Without any, the "
    "deployment's default applies (deny).",
)
@_api_command
async def create(
    space: AsyncSpace,
    template: str | None,
    vcpus: int | None,
    memory: int | None,
    disk: int | None,
    timeout: int | None,
    timeout_action: Literal["pause", "suspend", "delete"] | None,
    env: dict[str, str],
    metadata: dict[str, str],
    sandbox_id: str | None,
    volumes: list[dict[str, Any]],
    allow: tuple[str, ...],
) -> None:
    """Create a sandbox; prints its id once it is running."""
    sb = await AsyncSandbox.create(
        client=space,
        template=template,
        vcpus=vcpus,
        memory_mib=memory,
        disk_mib=disk,
        timeout_s=timeout,
        timeout_action=timeout_action,
        env=env or None,
        metadata=metadata or None,
        id=sandbox_id,
        volumes=volumes or None,
        network={"hosts": [{"pattern": h} for h in allow]} if allow else None,
    )
    if sb.state != "running":
        raise click.ClickException(f"sandbox {sb.id} is {sb.state}: {sb.info.reason or '?'}")
    click.echo(sb.id)


@sandbox.command("ls")
@click.option("--state", help="Only sandboxes in this state (running, paused, suspended, ...).")
@click.option("--template", help="Only sandboxes made from this template.")
@_pairs_option("--metadata", "-m", help="Only sandboxes with this label. Repeatable.")
@_api_command
async def list_sandboxes(
    space: AsyncSpace, state: str | None, template: str | None, metadata: dict[str, str]
) -> None:
    """List sandboxes, newest first."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "CREATED", "EXPIRES"):
        table.add_column(column, no_wrap=True)
    table.add_column("METADATA", overflow="fold")
    async for sb in AsyncSandbox.list(
        state=state, template=template, metadata=metadata, client=space
    ):
        table.add_row(*_row(sb.info))
    if table.row_count:
        # Piped, the table keeps one line per sandbox however wide, for grep and awk.
        Console(highlight=False, width=None if sys.stdout.isatty() else 1000).print(table)
    else:
        click.echo("no sandboxes", err=True)


def _row(info: SandboxInfo) -> list[str]:
    state = info.state
    if info.desired_state != state:
        state += f" → {info.desired_state}"
    if info.reason:
        state += f" ({info.reason})"
    return [
        info.id,
        state,
        info.template,
        str(info.vcpus),
        f"{info.memory_mib} MiB",
        _local_time(info.created_at),
        _local_time(info.expires_at),
        " ".join(f"{k}={v}" for k, v in info.metadata.items()),
    ]


@sandbox.command()
@click.argument("sandbox_id")
@_api_command
async def get(space: AsyncSpace, sandbox_id: str) -> None:
    """Print a sandbox as JSON."""
    sb = await AsyncSandbox.get(sandbox_id, client=space)
    data = dataclasses.asdict(sb.info)
    click.echo(json.dumps(data, indent=2, default=lambda value: value.isoformat()))


@sandbox.command()
@click.argument("sandbox_ids", nargs=-1, required=True)
@_api_command
async def rm(space: AsyncSpace, sandbox_ids: tuple[str, ...]) -> int:
    """Delete sandboxes (their disks and snapshots go too)."""
    failed = 0
    for sandbox_id in sandbox_ids:
        try:
            sb = await AsyncSandbox.get(sandbox_id, client=space)
            await sb.delete()
        except SpaceError as e:
            click.echo(f"{sandbox_id}: {e}", err=True)
            failed += 1
        else:
            click.echo(f"{sandbox_id} deleted")
    return 1 if failed else 0


async def _change(
    space: AsyncSpace, sandbox_id: str, action: Literal["pause", "resume", "suspend"]
) -> None:
    sb = await AsyncSandbox.get(sandbox_id, client=space)
    info = await {"pause": sb.pause, "resume": sb.resume, "suspend": sb.suspend}[action]()
    click.echo(f"{info.id} {info.state}")


@sandbox.command()
@click.argument("sandbox_id")
@_api_command
async def pause(space: AsyncSpace, sandbox_id: str) -> None:
    """Stop a sandbox's CPUs; its memory stays, so resuming takes milliseconds."""
    await _change(space, sandbox_id, "pause")


@sandbox.command()
@click.argument("sandbox_id")
@_api_command
async def resume(space: AsyncSpace, sandbox_id: str) -> None:
    """Run a paused or suspended sandbox again."""
    await _change(space, sandbox_id, "resume")


@sandbox.command()
@click.argument("sandbox_id")
@_api_command
async def suspend(space: AsyncSpace, sandbox_id: str) -> None:
    """Save a sandbox's memory to disk and free it; processes and files survive."""
    await _change(space, sandbox_id, "suspend")


# space exec / shell


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_exec_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    help="Kill the command after this many seconds.",
)
@click.option("--no-stdin", "-n", is_flag=True, help="Do not send our stdin (like ssh -n).")
@_api_command
async def exec_(
    space: AsyncSpace,
    sandbox_id: str,
    command: tuple[str, ...],
    env: dict[str, str],
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    no_stdin: bool,
) -> int:
    """Run a command in a sandbox, streaming its output.

    COMMAND comes after `--`; its exit status becomes ours (128 + the signal if one killed it).
    Piped stdin is read to its end, then sent.
    """
    sb = await AsyncSandbox.get(sandbox_id, client=space)
    stdin = None if no_stdin or sys.stdin.isatty() else sys.stdin.buffer.read()
    async with sb.exec_stream(
        command, env=env or None, cwd=cwd, user=user, timeout=timeout, stdin=stdin
    ) as stream:
        async for name, data in stream:
            out = sys.stdout if name == "stdout" else sys.stderr
            out.buffer.write(data)
            out.flush()
    if stream.result.timed_out:
        click.echo(f"space: timed out after {timeout}s, killed", err=True)
    return _status(stream.result)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_exec_options
@_api_command
async def shell(
    space: AsyncSpace,
    sandbox_id: str,
    command: tuple[str, ...],
    env: dict[str, str],
    cwd: str | None,
    user: str | None,
) -> int:
    """Open an interactive terminal in a sandbox.

    It runs a login shell, or COMMAND (after `--`), in a pseudo-terminal.
    """
    from space.client._shell import shell as attach  # httpx-ws: loaded only when needed

    result = await attach(space, sandbox_id, command or None, env=env or None, cwd=cwd, user=user)
    return _status(result)


# space cp


@click.command()
@click.argument("src")
@click.argument("dst")
@_api_command
async def cp(space: AsyncSpace, src: str, dst: str) -> None:
    """Copy a file into or out of a sandbox.

    One of SRC and DST is ID:/absolute/path, the other a local path; a DST that is a directory
    receives the file under its own name.
    """
    source, target = REMOTE_PATH.match(src), REMOTE_PATH.match(dst)
    if (source is None) == (target is None):
        raise click.UsageError("exactly one of SRC and DST must be a sandbox path, ID:/abs/path")
    if source is not None:
        sb = await AsyncSandbox.get(source["id"], client=space)
        await _download(sb, source["path"], Path(dst))
    elif target is not None:
        sb = await AsyncSandbox.get(target["id"], client=space)
        await _upload(sb, Path(src), target["path"])


@contextlib.contextmanager
def _progress(total: int, label: str) -> Iterator[Callable[[int], None]]:
    """A callback taking bytes moved; behind it, a progress bar for big files."""
    if total <= PROGRESS_FROM:
        yield lambda _: None
        return
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


async def _download(sb: AsyncSandbox, path: str, dst: Path) -> None:
    entry = await sb.files.stat(path)
    if entry.is_dir:
        raise click.ClickException(f"{sb.id}:{path} is a directory; cp copies one file")
    if dst.is_dir():
        dst /= entry.name
    # Into a temporary file first, so a failed copy leaves nothing half-written behind.
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    try:
        with os.fdopen(fd, "wb") as f, _progress(entry.size, dst.name) as advance:
            async for chunk in sb.files.iter(path):
                f.write(chunk)
                advance(len(chunk))
        os.chmod(tmp, entry.mode & 0o777)
        os.replace(tmp, dst)
    except BaseException:
        os.unlink(tmp)
        raise


async def _upload(sb: AsyncSandbox, src: Path, path: str) -> None:
    if src.is_dir():
        raise click.ClickException(f"{src} is a directory; cp copies one file")
    if path.endswith("/"):
        path += src.name
    else:
        with contextlib.suppress(NotFoundError):
            if (await sb.files.stat(path)).is_dir:
                path = f"{path}/{src.name}"
    with src.open("rb") as f, _progress(src.stat().st_size, src.name) as advance:
        mode = os.fstat(f.fileno()).st_mode & 0o777
        await sb.files.write(path, _counted(f, advance), mode=mode)


def _counted(f: BinaryIO, advance: Callable[[int], None]) -> Iterator[bytes]:
    for chunk in read_chunks(f):
        advance(len(chunk))
        yield chunk

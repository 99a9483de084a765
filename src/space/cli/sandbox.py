"""`space sandbox ...`, `space exec`, `space shell`: sandboxes through the HTTP API.

These commands are a client like any other: they use the SDK. The API's address and key come
from --api-url/--api-key, then SPACE_API_URL/SPACE_API_KEY, then the credentials file that
`space up` writes.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Concatenate, Literal, TypeVar

import click

from space.cli.completion import complete_sandbox_ids
from space.cli.output import json_option, print_json, print_table
from space.client._config import DEFAULT_API_URL, KEY_VARIABLE, URL_VARIABLE

# The SDK (httpx) and rich are imported where a command runs, not here: `--help` and argument
# errors answer without them (see main.py). Commands use the synchronous SDK: no event loop to
# start (asyncio and anyio cost ~30 ms); only `shell` needs one.
if TYPE_CHECKING:
    from datetime import datetime

    from space.client import ExecResult, ExecStream, SandboxInfo, Space
    from space.client._calls import ExecOptions


Body = Callable[Concatenate["Space", ...], int | None]
F = TypeVar("F", bound=Callable[..., Any])


def _api_options(fn: F) -> F:
    """--api-url and --api-key, which the command receives as `api_url` and `api_key`."""
    fn = click.option(
        "--api-key",
        envvar=KEY_VARIABLE,
        help=f"API key  [default: ${KEY_VARIABLE}, then the credentials file]",
    )(fn)
    return click.option(
        "--api-url",
        envvar=URL_VARIABLE,
        help=f"API address  [default: ${URL_VARIABLE}, then the credentials file, then "
        f"{DEFAULT_API_URL}]",
    )(fn)


@contextlib.contextmanager
def _sdk_errors() -> Iterator[None]:
    """SDK errors become one clear line, not a traceback."""
    from space.client import SpaceError

    try:
        yield
    except SpaceError as e:
        raise click.ClickException(str(e)) from None


def _api_command(body: Body) -> Callable[..., None]:
    """A command body taking an open `Space`, with --api-url and --api-key; a returned int is
    the exit status."""

    @_api_options
    @functools.wraps(body)
    def command(api_url: str | None, api_key: str | None, **kwargs: Any) -> None:
        from space.client import Space

        with _sdk_errors(), Space(api_url, api_key) as space:
            status = body(space, **kwargs)
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


def _secret(param: click.Parameter, value: str) -> dict[str, Any]:
    """`NAME:VAR:HOST[,HOST…]` as a binding: the guest gets a placeholder in $VAR, which the
    gateway swaps for the secret's value in requests to those hosts only."""
    name, var, hosts = [*value.split(":", 2), "", ""][:3]
    if not name or not var or not hosts:
        raise click.BadParameter(f"{value!r} is not NAME:VAR:HOST[,HOST...]", param=param)
    return {"secret": name, "env": var, "hosts": [h for h in hosts.split(",") if h]}


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


def print_output(stream: ExecStream) -> None:
    """A command's output as it comes: its stdout to ours, its stderr to ours."""
    for name, data in stream:
        out = sys.stdout if name == "stdout" else sys.stderr
        out.buffer.write(data)
        out.flush()


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
@click.option(
    "--idle-timeout",
    type=click.IntRange(min=0),
    help="Pause it after this many seconds unused; its next use resumes it (0: never)",
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
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    callback=lambda _c, p, vs: [_secret(p, v) for v in vs],
    metavar="NAME:VAR:HOST[,HOST]",
    help="Bind secret NAME (`space secret set`): $VAR holds a placeholder the gateway swaps for "
    "its value in requests to those hosts only. Repeatable.",
)
@_api_command
def create(
    space: Space,
    template: str | None,
    vcpus: int | None,
    memory: int | None,
    disk: int | None,
    timeout: int | None,
    timeout_action: Literal["pause", "suspend", "delete"] | None,
    idle_timeout: int | None,
    env: dict[str, str],
    metadata: dict[str, str],
    sandbox_id: str | None,
    volumes: list[dict[str, Any]],
    allow: tuple[str, ...],
    secrets: list[dict[str, Any]],
) -> None:
    """Create a sandbox; prints its id once it is running."""
    from space.client import Sandbox

    sb = Sandbox.create(
        client=space,
        template=template,
        vcpus=vcpus,
        memory_mib=memory,
        disk_mib=disk,
        timeout_s=timeout,
        timeout_action=timeout_action,
        idle_timeout_s=idle_timeout,
        env=env or None,
        metadata=metadata or None,
        id=sandbox_id,
        volumes=volumes or None,
        network={"hosts": [{"pattern": h} for h in allow]} if allow else None,
        secrets=secrets or None,
    )
    if sb.state != "running":
        raise click.ClickException(f"sandbox {sb.id} is {sb.state}: {sb.info.reason or '?'}")
    click.echo(sb.id)


@sandbox.command("ls")
@click.option("--state", help="Only sandboxes in this state (running, paused, suspended, ...).")
@click.option("--template", help="Only sandboxes made from this template.")
@_pairs_option("--metadata", "-m", help="Only sandboxes with this label. Repeatable.")
@json_option
@_api_command
def list_sandboxes(
    space: Space,
    state: str | None,
    template: str | None,
    metadata: dict[str, str],
    as_json: bool,
) -> None:
    """List sandboxes, newest first."""
    from space.client import Sandbox

    found = Sandbox.list(state=state, template=template, metadata=metadata, client=space)
    infos = [sb.info for sb in found]
    if as_json:
        print_json(infos)
        return
    print_table(
        ("ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "CREATED", "EXPIRES", "METADATA"),
        map(_row, infos),
        empty="no sandboxes",
    )


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
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@_api_command
def get(space: Space, sandbox_id: str) -> None:
    """Print a sandbox as JSON."""
    from space.client import Sandbox

    print_json((Sandbox.get(sandbox_id, client=space)).info)


@sandbox.command()
@click.argument("sandbox_ids", nargs=-1, required=True, shell_complete=complete_sandbox_ids)
@_api_command
def rm(space: Space, sandbox_ids: tuple[str, ...]) -> int:
    """Delete sandboxes (their disks and snapshots go too)."""
    from space.client import Sandbox, SpaceError

    failed = 0
    for sandbox_id in sandbox_ids:
        try:
            sb = Sandbox.get(sandbox_id, client=space)
            sb.delete()
        except SpaceError as e:
            click.echo(f"{sandbox_id}: {e}", err=True)
            failed += 1
        else:
            click.echo(f"{sandbox_id} deleted")
    return 1 if failed else 0


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.option(
    "--allow", multiple=True, metavar="HOST",
    help="A name (or *.domain) it may reach on ports 80/443. Repeatable.",
)  # fmt: skip
@click.option(
    "--default", "default", type=click.Choice(["deny", "allow"]), default="deny",
    show_default=True, help="For every other public name (private networks stay closed).",
)  # fmt: skip
@_api_command
def network(space: Space, sandbox_id: str, allow: tuple[str, ...], default: str) -> None:
    """Replace a sandbox's egress policy (a running one gets it at once)."""
    from space.client import Sandbox

    sb = Sandbox.get(sandbox_id, client=space)
    sb.set_network({"default": default, "hosts": [{"pattern": h} for h in allow]})
    allowed = f", allowed: {' '.join(allow)}" if allow else ""
    click.echo(f"{sb.id}: {default} by default{allowed}")


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.option("--after", type=click.IntRange(0), default=0, help="Only events numbered after.")
@json_option
@_api_command
def audit(space: Space, sandbox_id: str, after: int, as_json: bool) -> None:
    """The gateway's decisions on a sandbox's egress, oldest first."""
    from space.client import Sandbox

    events = Sandbox.get(sandbox_id, client=space).audit(after)
    if as_json:
        print_json(events)
        return
    rows = [
        (str(e.seq), _local_time(e.time), e.kind, e.decision, e.host or e.address or "",
         "" if e.port is None else str(e.port), e.reason)
        for e in events
    ]  # fmt: skip
    print_table(("SEQ", "TIME", "KIND", "DECISION", "HOST", "PORT", "REASON"), rows,
                empty="no egress yet")  # fmt: skip


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but tab and newline


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.option("--tail", type=click.IntRange(0, 1 << 20), default=65536, show_default=True,
              help="Bytes of its past.")  # fmt: skip
@click.option("-f", "--follow", is_flag=True, help="Then what comes, until it stops (or Ctrl-C).")
@_api_command
def logs(space: Space, sandbox_id: str, tail: int, follow: bool) -> None:
    """A sandbox's serial console: its kernel's and agent's messages, /dev/console."""
    from space.client import Sandbox

    # The guest writes it: on a terminal, its control sequences (a title, the clipboard, the
    # cursor) are dropped rather than obeyed.
    raw = not sys.stdout.isatty()
    for text in Sandbox.get(sandbox_id, client=space).logs(tail, follow):
        click.echo(text if raw else CONTROL.sub("", text), nl=False)


def _change(space: Space, sandbox_id: str, action: Literal["pause", "resume", "suspend"]) -> None:
    from space.client import Sandbox

    sb = Sandbox.get(sandbox_id, client=space)
    info = {"pause": sb.pause, "resume": sb.resume, "suspend": sb.suspend}[action]()
    click.echo(f"{info.id} {info.state}")


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@_api_command
def pause(space: Space, sandbox_id: str) -> None:
    """Stop a sandbox's CPUs; its memory stays, so resuming takes milliseconds."""
    _change(space, sandbox_id, "pause")


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@_api_command
def resume(space: Space, sandbox_id: str) -> None:
    """Run a paused or suspended sandbox again."""
    _change(space, sandbox_id, "resume")


@sandbox.command()
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@_api_command
def suspend(space: Space, sandbox_id: str) -> None:
    """Save a sandbox's memory to disk and free it; processes and files survive."""
    _change(space, sandbox_id, "suspend")


# space exec / shell


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@_exec_options
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    help="Kill the command after this many seconds.",
)
@click.option("--no-stdin", "-n", is_flag=True, help="Do not send our stdin (like ssh -n).")
@click.option(
    "--background", "-d", is_flag=True,
    help="Start it in the background and print its pid; `space process` follows it.",
)  # fmt: skip
@click.option("--tag", help="Name the background process (implies --background).")
@click.option("--keep-stdin", is_flag=True, help="Keep its stdin open for `space process stdin`.")
@_api_command
def exec_(
    space: Space,
    sandbox_id: str,
    command: tuple[str, ...],
    env: dict[str, str],
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    no_stdin: bool,
    background: bool,
    tag: str | None,
    keep_stdin: bool,
) -> int:
    """Run a command in a sandbox, streaming its output.

    COMMAND comes after `--`; its exit status becomes ours (128 + the signal if one killed it).
    Piped stdin is read to its end, then sent.
    """
    from space.client import Sandbox

    sb = Sandbox.get(sandbox_id, client=space)
    stdin = None if no_stdin or sys.stdin.isatty() else sys.stdin.buffer.read()
    options: ExecOptions = {"env": env or None, "cwd": cwd, "user": user, "timeout": timeout,
                            "stdin": stdin, "keep_stdin": keep_stdin}  # fmt: skip
    if background or tag:
        options["tag"] = tag
        click.echo(sb.processes.start(command, **options).pid)
        return 0
    with sb.exec_stream(command, **options) as stream:
        print_output(stream)
    if stream.result.timed_out:
        click.echo(f"space: timed out after {timeout}s, killed", err=True)
    return _status(stream.result)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("sandbox_id", shell_complete=complete_sandbox_ids)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@_exec_options
@_api_options
def shell(
    api_url: str | None,
    api_key: str | None,
    sandbox_id: str,
    command: tuple[str, ...],
    env: dict[str, str],
    cwd: str | None,
    user: str | None,
) -> None:
    """Open an interactive terminal in a sandbox.

    It runs a login shell, or COMMAND (after `--`), in a pseudo-terminal.
    """
    import asyncio

    from space.client import AsyncSpace
    from space.client._shell import shell as attach  # httpx-ws, over the async client

    async def run() -> ExecResult:
        async with AsyncSpace(api_url, api_key) as space:
            return await attach(
                space, sandbox_id, command or None, env=env or None, cwd=cwd, user=user
            )

    with _sdk_errors():
        result = asyncio.run(run())
    click.get_current_context().exit(_status(result))

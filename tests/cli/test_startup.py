"""The CLI answers at once because it imports only what a command needs. Guarded structurally
(which modules a run imports, by `python -X importtime`), not by timing; the figures are
`bench/cli_startup.py`'s."""

from __future__ import annotations

import ssl
import subprocess
import sys

import click
import pytest

from space.cli.main import COMMANDS, cli
from space.client._calls import _tls_context
from tests.cli.runner import modules, space
from tests.cli.stub_api import StubAPI, sandbox

# The database, the API server and the template builder: no client command needs any of them.
SERVER_SIDE = (
    "alembic",
    "sqlalchemy",
    "asyncpg",
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "space.db",
    "space.api",
    "space.controller",
    "space.worker",
)
# What only some commands need: the HTTP stack, rich, an event loop.
HTTP = ("httpx", "httpcore")
HEAVY_CLIENT = ("rich", "pygments", "asyncio", "httpx_ws")


def loaded(imported: set[str], roots: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imported if any(m == r or m.startswith(f"{r}.") for r in roots))


@pytest.mark.parametrize(
    "args",
    [["--version"], ["--help"], ["sandbox", "ls", "--help"], ["exec", "--help"], ["cp", "--help"]],
    ids=" ".join,
)
def test_help_and_version_import_no_http_and_no_server(args: list[str]) -> None:
    imported = modules(space(*args, importtime=True))
    assert loaded(imported, SERVER_SIDE + HTTP + HEAVY_CLIENT) == []
    # Only the command asked for is loaded, not its neighbours.
    assert loaded(imported, ("space.cli.services", "space.cli.admin", "space.cli.vm")) == []


def test_a_real_listing_imports_only_the_sync_http_client() -> None:
    with StubAPI([sandbox(n) for n in range(3)]) as api:
        imported = modules(space("sandbox", "ls", env=api.env(), importtime=True))
        assert len(api.requests) == 1  # it did ask the API
    assert loaded(imported, HTTP) != []
    assert loaded(imported, SERVER_SIDE + HEAVY_CLIENT) == []


def test_exec_reaches_the_api_without_an_event_loop() -> None:
    # The stub has no exec route: the command fails at the API (404), after importing all it
    # needs to run.
    with StubAPI() as api:
        run = space("exec", "sb-x", "--", "true", env=api.env(), status=1, importtime=True)
        assert api.requests == ["/v1/sandboxes/sb-x"]
    assert "404 Not Found" in run.stderr
    assert loaded(modules(run), SERVER_SIDE + HEAVY_CLIENT) == []


def test_completing_command_names_imports_no_command_module() -> None:
    env = {"_SPACE_COMPLETE": "bash_complete", "COMP_WORDS": "space ", "COMP_CWORD": "1"}
    run = space(env=env, importtime=True)
    offered = {line.split(",", 1)[1] for line in run.stdout.splitlines()}
    assert offered >= set(COMMANDS)
    imported = modules(run)
    assert loaded(imported, ("space.cli.sandbox", "space.cli.services", "space.cli.vm")) == []


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_summary_is_its_commands_own_short_help(name: str) -> None:
    real = COMMANDS[name].load()
    shown = click.Command(name, help=COMMANDS[name].summary)
    for limit in (45, 72, 200):
        assert shown.get_short_help_str(limit) == real.get_short_help_str(limit)


def test_every_command_is_listed_and_runs_its_help() -> None:
    ctx = click.Context(cli)
    assert cli.list_commands(ctx) == sorted(COMMANDS)
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        assert command is not None
        assert command.get_help(click.Context(command, info_name=name, parent=ctx))


def test_the_sdk_loads_its_parts_on_first_use() -> None:
    code = (
        "import sys\n"
        "from space.client import SpaceError, SandboxInfo\n"
        "import space.client._config\n"
        "assert 'httpx' not in sys.modules, 'errors and models need no HTTP stack'\n"
        "from space.client import Sandbox\n"
        "assert 'httpx' in sys.modules\n"
        "heavy = [m for m in ('rich', 'pygments', 'click', 'asyncio') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_http_api_gets_a_tls_context_that_trusts_nothing() -> None:
    assert _tls_context("https://api.example") is True  # httpx's default verification
    context = _tls_context("http://127.0.0.1:8080")
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0

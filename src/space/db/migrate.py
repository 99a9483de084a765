"""Bring a database to the newest schema (alembic, run programmatically on our connection).

A database a later release already migrated is left as it is: that release's migrations only
add what this one may ignore (expand, then contract: docs/upgrading.md), so this release runs
on it, and a rollback can start the previous release's services again.

A rollout migrates under live traffic, and the migrations, run in one transaction, take their
tables' locks one after another. The upgrade waits at most LOCK_WAIT for each lock it asks for,
so a table a long transaction holds does not stop every request behind the upgrade's queued
lock for longer; and when it and a request wait on each other, it usually gives up first
(PostgreSQL looks for a deadlock 1 s into a wait, and the one who looks gives up), so the
request goes on. A request that waited more than LOCK_WAIT before the upgrade did can still be
the one cancelled. The upgrade is tried again, whole, until RETRY_FOR_S have passed."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"
LOCK_KEY = 0x5350_4143  # serialises concurrent upgrades (several processes starting at once)
LOCK_WAIT = "500ms"  # under PostgreSQL's default deadlock_timeout (1 s)
RETRY_FOR_S = 120.0
# lock_not_available (lock_timeout) and deadlock_detected: another try may go through.
BUSY = {"55P03", "40P01"}


def _config(connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection) -> str | None:
    """Upgrades to this release's newest revision; or, when the database is at a revision this
    release does not know, leaves it and returns that revision."""
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})")
    # After the advisory lock: another process's upgrade is waited for as before (within the
    # connection's statement timeout).
    connection.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_WAIT}'")
    cfg = _config(connection)
    current = MigrationContext.configure(connection).get_current_revision()
    known = {script.revision for script in ScriptDirectory.from_config(cfg).walk_revisions()}
    if current is not None and current not in known:
        return current
    command.upgrade(cfg, "head")
    return None


async def upgrade(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + RETRY_FOR_S
    for attempt in itertools.count():
        try:
            async with engine.begin() as conn:
                newer = await conn.run_sync(_upgrade)
            break
        except DBAPIError as e:
            if getattr(e.orig, "sqlstate", None) not in BUSY or time.monotonic() > deadline:
                raise
            pause = min(5.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("the schema upgrade gave way to requests holding its tables (%s); "
                        "trying again in %.1f s", e.orig, pause)  # fmt: skip
            await asyncio.sleep(pause)
    if newer is not None:
        log.warning(
            "the database's schema is at revision %s, which this release does not know: a "
            "later release migrated it; running on it as it is", newer,
        )  # fmt: skip


async def revision(engine: AsyncEngine) -> str | None:
    """The schema revision the database is at (None before the first upgrade)."""
    async with engine.connect() as conn:
        current: str | None = await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision()
        )
        return current

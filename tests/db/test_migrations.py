"""The migrations build exactly the schema the code declares, on a real PostgreSQL."""

from __future__ import annotations

import asyncio

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from space.db import migrate
from space.db.store import connect
from space.db.tables import metadata
from tests.cli.runner import space
from tests.db.conftest import new_database


async def test_upgrade_matches_the_declared_tables_and_is_repeatable(database: str) -> None:
    engine = connect(database)
    try:
        await migrate.upgrade(engine)
        await migrate.upgrade(engine)  # a second run (another process starting) changes nothing

        def diff(conn: Connection) -> list[object]:
            return list(compare_metadata(MigrationContext.configure(conn), metadata))

        async with engine.connect() as conn:
            assert await conn.run_sync(diff) == []
    finally:
        await engine.dispose()


async def test_admin_migrate_brings_a_new_database_to_the_newest_revision(database: str) -> None:
    """The command a deployment runs on each rollout (`space admin migrate`), as a process."""
    url = await new_database(database, "rollout")
    head = ScriptDirectory(str(migrate.MIGRATIONS)).get_current_head()
    assert head is not None
    for _ in range(2):  # the second rollout finds nothing to do and says the same
        run = await asyncio.to_thread(space, "admin", "migrate", env={"SPACE_DATABASE_URL": url})
        assert run.stdout.strip() == head
    engine = connect(url)
    try:
        assert await migrate.revision(engine) == head
    finally:
        await engine.dispose()


async def test_a_schema_a_later_release_migrated_is_left_as_it_is(database: str) -> None:
    """A rollback starts the previous release's services on the newer schema: they run on it
    instead of failing on a revision they do not know."""
    url = await new_database(database, "later")
    engine = connect(url)
    try:
        await migrate.upgrade(engine)
        async with engine.begin() as conn:
            await conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9001'")
        await migrate.upgrade(engine)
        assert await migrate.revision(engine) == "9001"
    finally:
        await engine.dispose()
    run = await asyncio.to_thread(space, "admin", "migrate", env={"SPACE_DATABASE_URL": url})
    assert run.stdout.strip() == "9001" and "does not know" in run.stderr, run


async def test_an_upgrade_under_traffic_gives_way_to_the_requests_it_deadlocks_with(
    database: str,
) -> None:
    """A rollout's migrations lock table after table while requests run: when a request holds
    a table the upgrade wants and waits for one the upgrade holds, the upgrade gives way and
    is tried again; the request goes through."""
    url = await new_database(database, "busy")
    engine = connect(url)
    try:
        async with engine.begin() as conn:  # the schema of a release before 0018
            await conn.run_sync(lambda c: command.upgrade(migrate._config(c), "0017"))
        async with engine.connect() as request:
            await request.begin()
            await request.exec_driver_sql("SELECT count(*) FROM templates")  # holds templates
            upgrading = asyncio.ensure_future(migrate.upgrade(engine))
            # The upgrade took sandboxes (0018) and waits for templates (0021)...
            async with engine.connect() as look:
                for _ in range(200):
                    waiting = await look.scalar(text(
                        "SELECT count(*) FROM pg_locks WHERE NOT granted "
                        "AND relation = 'templates'::regclass"
                    ))  # fmt: skip
                    if waiting:
                        break
                    await asyncio.sleep(0.05)
                assert waiting, "the upgrade never waited for the table the request holds"
            # ...which the request now wants too: each waits for the other.
            assert await request.scalar(text("SELECT count(*) FROM sandboxes")) == 0
            await request.commit()
        await asyncio.wait_for(upgrading, 60)
        assert (
            await migrate.revision(engine)
            == ScriptDirectory(str(migrate.MIGRATIONS)).get_current_head()
        )
    finally:
        await engine.dispose()

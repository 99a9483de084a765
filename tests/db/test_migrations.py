"""The migrations build exactly the schema the code declares, on a real PostgreSQL."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection

from space.db import migrate
from space.db.store import connect
from space.db.tables import metadata


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

"""Restores on a real PostgreSQL: the backup's schema and rows replace the database's whole,
or nothing changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

from space.db import backup, migrate
from space.db.store import Store, connect
from tests.db.conftest import new_database

EARLIER = "0014"  # the schema of release 0.1, before `strays`


async def _tenants(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as c:
        names = (await c.execute(sa.text("SELECT name FROM tenants"))).scalars()
        return {n for n in names if n != "(warm pool)"}  # the migrations' own


async def test_a_backup_of_an_earlier_release_restores_over_a_later_schema(
    database: str, tmp_path: Path
) -> None:
    url = await new_database(database, "earlier")
    store = Store(connect(url))
    try:

        def to_earlier(conn: Connection) -> None:
            command.upgrade(migrate._config(conn), EARLIER)

        async with store.engine.begin() as c:
            await c.run_sync(to_earlier)
        await store.create_tenant("kept")
        dump = tmp_path / "earlier.dump"
        await backup.backup(url, dump)

        await migrate.upgrade(store.engine)  # the later release's schema, and its rows
        await store.create_tenant("made-after")
        await backup.restore(url, dump, store.engine)

        assert await migrate.revision(store.engine) == EARLIER
        assert await _tenants(store.engine) == {"kept"}
        await migrate.upgrade(store.engine)  # the later release's migrations run over it again
        assert await migrate.revision(store.engine) != EARLIER
    finally:
        await store.close()


async def test_a_restore_that_fails_changes_nothing(database: str, tmp_path: Path) -> None:
    url = await new_database(database, "unchanged")
    store = Store(connect(url))
    try:
        await migrate.upgrade(store.engine)
        await store.create_tenant("still-here")
        dump = tmp_path / "whole.dump"
        await backup.backup(url, dump)
        cut = tmp_path / "cut.dump"
        cut.write_bytes(dump.read_bytes()[: dump.stat().st_size * 2 // 3])  # a torn copy
        with pytest.raises(backup.BackupError):
            await backup.restore(url, cut, store.engine)
        assert await _tenants(store.engine) == {"still-here"}
    finally:
        await store.close()

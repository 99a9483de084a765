from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.db import embedded, migrate, tables
from space.db.store import Store, connect


@pytest.fixture(scope="package")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL (the embedded one) for the package's tests."""
    pgdata: Path = tmp_path_factory.mktemp("pg") / "data"
    url = embedded.start(pgdata)
    yield url
    embedded.stop(pgdata)


async def new_database(url: str, name: str) -> str:
    """The URL of a new, empty database `name` on the server of `url`."""
    admin = connect(url).execution_options(isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.exec_driver_sql(f"CREATE DATABASE {name}")
    await admin.dispose()
    return url.replace("/postgres?", f"/{name}?")


# Rows of every table a module may fill, children before the tables they point at.
TABLES = ("events", "checkpoints", "sandboxes", "workers", "templates")


async def clean(s: Store) -> None:
    """An empty slate of sandboxes, workers and templates (tenants and keys stay)."""
    async with s.engine.begin() as c:
        for name in TABLES:
            await c.execute(tables.metadata.tables[name].delete())


@pytest.fixture
async def store(database: str) -> AsyncIterator[Store]:
    """A store on that database, migrated (modules that need a clean slate make their own)."""
    s = Store(connect(database))
    await migrate.upgrade(s.engine)
    yield s
    await s.close()

"""Bring a database to the newest schema (alembic, run programmatically on our connection)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = Path(__file__).parent / "migrations"
LOCK_KEY = 0x5350_4143  # serialises concurrent upgrades (several processes starting at once)


def _config(connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def _upgrade(connection: Connection) -> None:
    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({LOCK_KEY})")
    command.upgrade(_config(connection), "head")


async def upgrade(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade)


async def revision(engine: AsyncEngine) -> str | None:
    """The schema revision the database is at (None before the first upgrade)."""
    async with engine.connect() as conn:
        current: str | None = await conn.run_sync(
            lambda c: MigrationContext.configure(c).get_current_revision()
        )
        return current

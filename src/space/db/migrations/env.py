"""Alembic environment: runs on the connection `space.db.migrate` hands it."""

from __future__ import annotations

from alembic import context

from space.db.tables import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata, transaction_per_migration=True)
with context.begin_transaction():
    context.run_migrations()

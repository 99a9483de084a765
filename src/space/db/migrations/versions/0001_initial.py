"""The initial schema: tenants, API keys, templates, workers, sandboxes, events.

This first revision creates the tables as `space.db.tables` declares them. Every later change
gets a revision of its own with explicit operations (and this one is then frozen as explicit
operations too, so that replaying history never depends on today's table declarations).

Revision ID: 0001
"""

from __future__ import annotations

from alembic import op

from space.db.tables import metadata

revision = "0001"
down_revision = None


def upgrade() -> None:
    metadata.create_all(op.get_bind())


def downgrade() -> None:
    metadata.drop_all(op.get_bind())

"""Tenants are deleted by marking them: their rows stay for what still names them (sandboxes
being deleted, usage, the audit log).

Revision ID: 0020
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"


def upgrade() -> None:
    op.add_column("tenants", sa.Column("deleted_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("tenants", "deleted_at")

"""Templates built by workers: build state, where, and the built template's record.

Revision ID: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.add_column(
        "templates", sa.Column("state", sa.Text(), server_default="ready", nullable=False)
    )
    op.add_column("templates", sa.Column("worker_id", sa.Text(), nullable=True))
    op.create_foreign_key(None, "templates", "workers", ["worker_id"], ["id"])
    op.add_column("templates", sa.Column("build_id", sa.Text(), nullable=True))
    op.add_column("templates", sa.Column("error", sa.Text(), nullable=True))
    op.add_column(
        "templates", sa.Column("record", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column(
        "templates",
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
    )


def downgrade() -> None:
    for column in ("updated_at", "record", "error", "build_id", "worker_id", "state"):
        op.drop_column("templates", column)

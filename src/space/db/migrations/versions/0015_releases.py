"""Releases: each worker's release, as it registered and its probes say (space.release); the
strays a worker holds that a restored database does not know (db/store/strays.py).

Revision ID: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"


def upgrade() -> None:
    op.add_column(
        "workers", sa.Column("version", sa.Text(), nullable=False, server_default="0.1.0")
    )
    op.create_table(
        "strays",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("worker_id", sa.Text(), nullable=False),
        sa.Column(
            "found_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("discarded", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_table("strays")
    op.drop_column("workers", "version")

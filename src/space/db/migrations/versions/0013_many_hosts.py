"""Many hosts: templates and suspended sandboxes in the registry run and resume on any worker.

Each worker's probes say which templates it holds and whether it pushes to a registry; a
suspended sandbox keeps where its snapshot was pushed, a detached volume where its image was; a
worker being drained takes no new work.

Revision ID: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"


def upgrade() -> None:
    op.add_column(
        "workers",
        sa.Column("templates", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
    )
    for flag in ("draining", "registry"):
        op.add_column(
            "workers", sa.Column(flag, sa.Boolean(), nullable=False, server_default="false")
        )
    op.add_column("sandboxes", sa.Column("artifact", sa.Text(), nullable=True))
    op.add_column("volumes", sa.Column("artifact", sa.Text(), nullable=True))
    op.add_column(
        "volumes", sa.Column("generation", sa.Integer(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("volumes", "generation")
    op.drop_column("volumes", "artifact")
    op.drop_column("sandboxes", "artifact")
    op.drop_column("workers", "registry")
    op.drop_column("workers", "draining")
    op.drop_column("workers", "templates")

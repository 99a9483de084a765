"""Templates made of checkpoints: a queued build may name a checkpoint instead of a spec.

Revision ID: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    op.add_column("template_builds", sa.Column("checkpoint_id", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("template_builds", "checkpoint_id")

"""Fair shares: each worker's probes say what one sandbox may take of its disk and network.

Revision ID: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    op.add_column(
        "workers",
        sa.Column("shares", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
    )


def downgrade() -> None:
    op.drop_column("workers", "shares")

"""Files E2B's template builder uploads for its COPY steps before it starts a build: each a
tar, kept by its tenant and the SDK's hash of it for a day (later builds of the same files
find them here).

Revision ID: 0023
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"


def upgrade() -> None:
    op.create_table(
        "e2b_uploads",
        sa.Column("tenant_id", sa.Text(), primary_key=True),
        sa.Column("hash", sa.Text(), primary_key=True),
        sa.Column("token_sha256", sa.LargeBinary(), nullable=False),
        sa.Column("data", sa.LargeBinary()),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
        ),
    )


def downgrade() -> None:
    op.drop_table("e2b_uploads")

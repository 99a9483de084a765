"""The API request behind each sandbox's desired state, for logs that follow a request.

Revision ID: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("request_id", sa.Text))


def downgrade() -> None:
    op.drop_column("sandboxes", "request_id")

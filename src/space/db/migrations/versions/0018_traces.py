"""Traces: a sandbox keeps the trace of the request that asked for its state (space.tracing).

Revision ID: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"


def upgrade() -> None:
    op.add_column("sandboxes", sa.Column("trace_parent", sa.Text()))


def downgrade() -> None:
    op.drop_column("sandboxes", "trace_parent")

"""Density: the memory a worker measures in use, and the idle policy's activity marks.

Revision ID: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    # What the worker measured its VMs to take (PSS, plus room held for VMs being made or
    # resumed), and when: placement adds what it placed there since.
    op.add_column("workers", sa.Column("used_memory_mib", sa.Integer))
    op.add_column("workers", sa.Column("measured_at", sa.DateTime(timezone=True)))
    op.add_column("sandboxes", sa.Column("idle_timeout_s", sa.Integer))
    op.add_column("sandboxes", sa.Column("active_at", sa.DateTime(timezone=True)))
    # Paused by the idle policy (not by its owner): its next exec, file call or ingress resumes it.
    op.add_column(
        "sandboxes", sa.Column("idle_paused", sa.Boolean, nullable=False, server_default=sa.false())
    )


def downgrade() -> None:
    for table, column in (("workers", "used_memory_mib"), ("workers", "measured_at"),
                          ("sandboxes", "idle_timeout_s"), ("sandboxes", "active_at"),
                          ("sandboxes", "idle_paused")):  # fmt: skip
        op.drop_column(table, column)

"""Leases for leadership, claims and policy versions on sandboxes, health figures of workers,
and template builds asked for through the database.

Revision ID: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    op.create_table(
        "leases",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("holder", sa.Text(), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "template_builds",
        sa.Column("template_id", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("spec", sa.Text(), nullable=False),
        sa.Column("context", sa.LargeBinary(), nullable=False),
        sa.Column("environ_key_id", sa.Text(), nullable=True),
        sa.Column("environ_sealed", sa.LargeBinary(), nullable=True),
        sa.Column(
            "requested_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(["template_id"], ["templates.id"]),
        sa.PrimaryKeyConstraint("template_id"),
    )
    for name in ("network_version", "network_applied"):
        op.add_column(
            "sandboxes", sa.Column(name, sa.Integer(), server_default="0", nullable=False)
        )
    op.add_column("sandboxes", sa.Column("claim_token", sa.Text(), nullable=True))
    for name in ("overhead_mib", "capacity_disk_mib", "used_disk_mib"):
        op.add_column("workers", sa.Column(name, sa.Integer(), server_default="0", nullable=False))
    op.add_column("workers", sa.Column("problem", sa.Text(), nullable=True))


def downgrade() -> None:
    for name in ("problem", "used_disk_mib", "capacity_disk_mib", "overhead_mib"):
        op.drop_column("workers", name)
    for name in ("claim_token", "network_applied", "network_version"):
        op.drop_column("sandboxes", name)
    op.drop_table("template_builds")
    op.drop_table("leases")

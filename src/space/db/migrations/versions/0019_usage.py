"""Metering (space.controller.metering): what each sandbox and volume used, per time bucket and
state; its gateway traffic by host; each tenant's running totals (Prometheus counters); up to
when time in each state has been counted.

Revision ID: 0019
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"

FIGURES = (
    ("seconds", sa.Float()),
    ("vcpu_seconds", sa.Float()),
    ("memory_gib_seconds", sa.Float()),
    ("cpu_seconds", sa.Float()),
    ("disk_gib_hours", sa.Float()),
    ("snapshot_gib_hours", sa.Float()),
    ("checkpoint_gib_hours", sa.Float()),
    ("volume_gib_hours", sa.Float()),
    ("net_rx_bytes", sa.BigInteger()),
    ("net_tx_bytes", sa.BigInteger()),
    ("egress_bytes", sa.BigInteger()),
    ("ingress_bytes", sa.BigInteger()),
)


def _figures() -> list[sa.Column[object]]:
    return [sa.Column(name, kind, nullable=False, server_default="0") for name, kind in FIGURES]


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_s", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("template", sa.Text(), nullable=False, server_default=""),
        sa.Column("state", sa.Text(), nullable=False),
        *_figures(),
        sa.PrimaryKeyConstraint("subject", "bucket", "step_s", "state", "tenant_id"),
    )
    op.create_index("usage_tenant", "usage", ["tenant_id", "bucket"])
    op.create_index("usage_bucket", "usage", ["bucket"])
    op.create_table(
        "usage_traffic",
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("step_s", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("sandbox_id", sa.Text(), nullable=False),
        sa.Column("host", sa.Text(), nullable=False),
        sa.Column("sent", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("received", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("sandbox_id", "bucket", "step_s", "host", "tenant_id"),
    )
    op.create_index("usage_traffic_tenant", "usage_traffic", ["tenant_id", "bucket"])
    op.create_index("usage_traffic_bucket", "usage_traffic", ["bucket"])
    op.create_table(
        "usage_cursor",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "usage_totals",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        *_figures(),
        sa.PrimaryKeyConstraint("tenant_id", "state"),
    )


def downgrade() -> None:
    for table in ("usage_totals", "usage_cursor", "usage_traffic", "usage"):
        op.drop_table(table)

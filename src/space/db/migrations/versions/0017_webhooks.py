"""Lifecycle webhooks (space.webhooks): endpoints, deliveries, attempts, and how far the leader
has read the events for them (from the newest event at this migration: no history is sent).

Revision ID: 0017
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0017"
down_revision = "0016"

NOW = sa.text("now()")


def upgrade() -> None:
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Text(), primary_key=True),
        sa.Column("tenant_id", sa.Text(), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("events", JSONB(), nullable=False),
        sa.Column("description", sa.Text(), nullable=False, server_default=""),
        sa.Column("key_id", sa.Text(), nullable=False),
        sa.Column("sealed_secret", sa.LargeBinary(), nullable=False),
        sa.Column("after_event", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    )
    op.create_index("webhooks_tenant", "webhooks", ["tenant_id"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "webhook_id",
            sa.Text(),
            sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("payload", JSONB(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("next_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("state", sa.Text(), nullable=False, server_default="pending"),
        sa.UniqueConstraint("webhook_id", "event_id", "type"),
    )
    op.create_index("webhook_deliveries_due", "webhook_deliveries", ["state", "next_at"])
    op.create_table(
        "webhook_attempts",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "delivery_id",
            sa.BigInteger(),
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
        sa.Column("status", sa.Integer()),
        sa.Column("error", sa.Text()),
        sa.Column("ms", sa.Float(), nullable=False),
    )
    op.create_index("webhook_attempts_delivery", "webhook_attempts", ["delivery_id"])
    op.create_table(
        "webhook_cursor",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
    )
    op.execute(
        "INSERT INTO webhook_cursor (id, event_id) SELECT 1, coalesce(max(id), 0) FROM events"
    )


def downgrade() -> None:
    for table in ("webhook_cursor", "webhook_attempts", "webhook_deliveries", "webhooks"):
        op.drop_table(table)

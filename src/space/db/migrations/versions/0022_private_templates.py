"""Templates of one tenant: a snapshot of a sandbox (E2B's `create_snapshot`) is a template
only its tenant sees and starts sandboxes of; the sandbox it was made of, and the name it was
given, for listing them; what it holds, which its tenant's checkpoint quotas count.

Revision ID: 0022
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"


def upgrade() -> None:
    op.add_column("templates", sa.Column("tenant_id", sa.Text()))
    op.add_column("templates", sa.Column("source_sandbox_id", sa.Text()))
    op.add_column("templates", sa.Column("label", sa.Text()))
    op.add_column(
        "templates", sa.Column("held_bytes", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.create_index("templates_tenant", "templates", ["tenant_id", "created_at"])


def downgrade() -> None:
    # Without the owner every tenant would see and start another's snapshots.
    held = op.get_bind().scalar(
        sa.text("SELECT count(*) FROM templates WHERE tenant_id IS NOT NULL")
    )
    if held:
        raise RuntimeError(f"{held} templates are tenants' own snapshots: delete them first")
    op.drop_column("templates", "held_bytes")
    op.drop_index("templates_tenant", "templates")
    op.drop_column("templates", "label")
    op.drop_column("templates", "source_sandbox_id")
    op.drop_column("templates", "tenant_id")

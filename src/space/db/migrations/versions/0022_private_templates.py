"""Templates of one tenant: a snapshot of a sandbox (E2B's `create_snapshot`) is a template
only its tenant sees and starts sandboxes of; the sandbox it was made of, and the name it was
given, for listing them.

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
    op.create_index("templates_tenant", "templates", ["tenant_id", "created_at"])


def downgrade() -> None:
    op.drop_index("templates_tenant", "templates")
    op.drop_column("templates", "label")
    op.drop_column("templates", "source_sandbox_id")
    op.drop_column("templates", "tenant_id")

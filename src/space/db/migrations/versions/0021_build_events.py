"""Whose key asked for a template's build, so that its end is announced to that tenant (an
event of type `build`, which webhooks send as `template.build_finished`).

Revision ID: 0021
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"


def upgrade() -> None:
    op.add_column("template_builds", sa.Column("tenant_id", sa.Text()))
    op.add_column("templates", sa.Column("build_tenant_id", sa.Text()))


def downgrade() -> None:
    op.drop_column("templates", "build_tenant_id")
    op.drop_column("template_builds", "tenant_id")

"""The audit trail of the control plane (db/store/audit.py), append-only.

Revision ID: 0016
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0015"

# Nothing that uses the database may change or remove what was recorded; an operator who must
# prune old entries drops the trigger first, on purpose (docs/upgrading.md).
APPEND_ONLY = (
    """CREATE FUNCTION audit_log_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        RAISE EXCEPTION 'the audit log is append-only: % refused', TG_OP;
    END $$""",
    """CREATE TRIGGER audit_log_no_change BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION audit_log_append_only()""",
    """CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION audit_log_append_only()""",
)


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("now()")
        ),
        sa.Column("tenant_id", sa.Text()),
        sa.Column("key_id", sa.Text()),
        sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("method", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("params", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("created", sa.Text()),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.Text()),
        sa.Column("remote", sa.Text()),
    )
    op.create_index("audit_log_tenant", "audit_log", ["tenant_id", "id"])
    for statement in APPEND_ONLY:
        op.execute(statement)


def downgrade() -> None:
    op.drop_table("audit_log")
    op.execute("DROP FUNCTION audit_log_append_only()")

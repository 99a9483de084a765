"""Warm pools: pool size and shape per template, pool members, boot path, admin keys.

Revision ID: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"

# Pool members belong to this tenant until a create claims them; no API key is ever made for it.
POOL_TENANT = ("tn-pool", "(warm pool)")


def upgrade() -> None:
    op.add_column(
        "api_keys", sa.Column("admin", sa.Boolean(), server_default=sa.false(), nullable=False)
    )
    for name, default in (("size", "0"), ("vcpus", "1"), ("memory_mib", "256"),
                          ("disk_mib", "1024")):  # fmt: skip
        op.add_column(
            "templates",
            sa.Column(f"pool_{name}", sa.Integer(), server_default=default, nullable=False),
        )
    op.add_column("workers", sa.Column("mem_available_mib", sa.Integer(), nullable=True))
    op.add_column(
        "sandboxes", sa.Column("pool", sa.Boolean(), server_default=sa.false(), nullable=False)
    )
    op.add_column("sandboxes", sa.Column("boot", sa.Text(), nullable=True))
    op.create_index(
        "sandboxes_pool",
        "sandboxes",
        ["template", "vcpus", "memory_mib", "disk_mib", "created_at"],
        unique=False,
        postgresql_where=sa.text("pool"),
    )
    op.execute(
        sa.text(
            "INSERT INTO tenants (id, name) VALUES (:id, :name) ON CONFLICT DO NOTHING"
        ).bindparams(id=POOL_TENANT[0], name=POOL_TENANT[1])
    )


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM tenants WHERE id = :id").bindparams(id=POOL_TENANT[0]))
    op.drop_index("sandboxes_pool", table_name="sandboxes")
    op.drop_column("sandboxes", "boot")
    op.drop_column("sandboxes", "pool")
    op.drop_column("workers", "mem_available_mib")
    for name in ("size", "vcpus", "memory_mib", "disk_mib"):
        op.drop_column("templates", f"pool_{name}")
    op.drop_column("api_keys", "admin")

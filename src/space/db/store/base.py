"""What every kind of record's queries share: the engine, the errors, ids, events, NOTIFY.

State changes are compare-and-set (`UPDATE … WHERE state IN (…)`), so two processes racing
for the same sandbox never both win, and every change of a sandbox is announced on the
`space_sandbox` channel (LISTEN/NOTIFY) so waiters and the controller wake at once.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from space.db import tables as t

CHANNEL = "space_sandbox"
POOL_TENANT = "tn-pool"  # owns warm-pool members until a create claims one (migration 0002)
POOL_NAME = "(warm pool)"
TRANSITIONAL = ("pending", "starting", "claiming", "pausing", "resuming", "suspending",
                "deleting")  # fmt: skip
# Keepalives on every connection, so a half-open one (a host gone, a partition) is noticed in
# seconds, not in the kernel's two hours; and no statement may run longer than a minute.
SERVER_SETTINGS = {
    "tcp_keepalives_idle": "5",
    "tcp_keepalives_interval": "2",
    "tcp_keepalives_count": "3",
    "statement_timeout": "60000",
}

Row = sa.RowMapping


class NotFound(Exception):
    pass


class Conflict(Exception):
    """A state change that the sandbox's current state does not allow."""

    def __init__(self, sandbox_id: str, state: str, wanted: str) -> None:
        super().__init__(f"sandbox {sandbox_id} is {state}: cannot {wanted}")
        self.state = state


class Refused(Exception):
    """A request about volumes or templates that cannot be done as asked; `status` is the HTTP
    answer, the message says why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Tenant:
    id: str
    name: str
    admin: bool = False  # the key used is an admin key
    key_id: str | None = None  # the key used, when the tenant came from one


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(8)}"


def connect(url: str, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=20,
        pool_pre_ping=True,
        pool_timeout=10,
        connect_args={"server_settings": SERVER_SETTINGS, "timeout": 10, "command_timeout": 60},
    )


class Queries:
    """Base of each kind of record's queries; `Store` puts them together on one engine."""

    engine: AsyncEngine


async def notify(c: AsyncConnection, sandbox_id: str) -> None:
    await c.execute(sa.select(sa.func.pg_notify(CHANNEL, sandbox_id)))


async def event(
    c: AsyncConnection,
    row: Row,
    kind: str,
    from_state: str | None,
    to_state: str | None,
    reason: str | None,
) -> None:
    await c.execute(
        t.events.insert().values(
            sandbox_id=row["id"],
            tenant_id=row["tenant_id"],
            type=kind,
            from_state=from_state,
            to_state=to_state,
            reason=reason,
        )
    )

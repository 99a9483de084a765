"""Every query SPACE makes: one module per kind of record, behind the `Store` facade.

`Store(engine)` has every query; the modules say where each kind lives: `tenants` (and API
keys), `templates` (and their builds), `pools` (warm-pool members and claims), `sandboxes`
(rows, transitions, events), `checkpoints` (and forks), `secrets`, `volumes`, `workers`,
`leases` (leadership),
`audit` (the control plane's trail), `webhooks` (endpoints, deliveries, attempts), `usage`
(metering).
"""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine

from space.db.store.audit import AuditEntry, AuditQueries, AuditQuery
from space.db.store.base import (
    CHANNEL,
    POOL_NAME,
    POOL_TENANT,
    TRANSITIONAL,
    Conflict,
    NotFound,
    Refused,
    Row,
    Tenant,
    connect,
    new_id,
)
from space.db.store.checkpoints import CheckpointQueries
from space.db.store.leases import LEADER, LeaseQueries
from space.db.store.pools import PoolQueries
from space.db.store.quotas import QuotaQueries
from space.db.store.sandboxes import SandboxQueries
from space.db.store.secrets import SecretQueries
from space.db.store.strays import StrayQueries
from space.db.store.templates import TemplateQueries
from space.db.store.tenants import KEY_PREFIX, TenantQueries, key_id_of
from space.db.store.uploads import UploadQueries
from space.db.store.usage import UsageQueries
from space.db.store.volumes import VolumeQueries
from space.db.store.webhooks import WebhookQueries
from space.db.store.workers import WorkerQueries


class Store(
    TenantQueries,
    TemplateQueries,
    PoolQueries,
    CheckpointQueries,
    QuotaQueries,
    SandboxQueries,
    SecretQueries,
    StrayQueries,
    VolumeQueries,
    WorkerQueries,
    LeaseQueries,
    AuditQueries,
    WebhookQueries,
    UsageQueries,
    UploadQueries,
):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def close(self) -> None:
        await self.engine.dispose()


__all__ = [
    "CHANNEL",
    "KEY_PREFIX",
    "LEADER",
    "POOL_NAME",
    "POOL_TENANT",
    "TRANSITIONAL",
    "AuditEntry",
    "AuditQuery",
    "Conflict",
    "NotFound",
    "Refused",
    "Row",
    "Store",
    "Tenant",
    "connect",
    "key_id_of",
    "new_id",
]

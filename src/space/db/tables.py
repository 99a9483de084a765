"""The schema, as SQLAlchemy Core tables (migrations in `migrations/` create the same)."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

metadata = sa.MetaData()

NOW = sa.text("now()")

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    # An operator's overrides of the deployment's default quotas (space.quotas).
    sa.Column("quotas", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # Deleted (its name freed, its keys revoked, what it held deleted); the row stays.
    sa.Column("deleted_at", sa.DateTime(timezone=True)),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),  # the key's public prefix
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("secret_sha256", sa.LargeBinary, nullable=False),
    sa.Column("name", sa.Text, nullable=False, server_default=""),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("revoked_at", sa.DateTime(timezone=True)),
    # Admin keys also manage what every tenant shares: templates and their warm pools.
    sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
)

templates = sa.Table(
    "templates",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    # The warm pool: this many sandboxes of this shape kept restored and ready to be claimed.
    sa.Column("pool_size", sa.Integer, nullable=False, server_default="0"),
    sa.Column("pool_vcpus", sa.Integer, nullable=False, server_default="1"),
    sa.Column("pool_memory_mib", sa.Integer, nullable=False, server_default="256"),
    sa.Column("pool_disk_mib", sa.Integer, nullable=False, server_default="1024"),
    # Built templates: ready once their worker has built them (`base` is on every worker).
    # queued (a build asked for) | building | ready | failed | deleting
    sa.Column("state", sa.Text, nullable=False, server_default="ready"),
    sa.Column("worker_id", sa.Text, sa.ForeignKey("workers.id")),
    sa.Column("build_id", sa.Text),
    sa.Column("error", sa.Text),
    sa.Column("record", JSONB),  # the worker's template.json: digest, env, workdir, start, …
    sa.Column("build_tenant_id", sa.Text),  # whose key asked for its latest build
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    # A tenant's own (a snapshot of one of its sandboxes): only it sees the template and starts
    # sandboxes of it. None: every tenant's.
    sa.Column("tenant_id", sa.Text),
    sa.Column("source_sandbox_id", sa.Text),  # the sandbox a snapshot was made of
    sa.Column("label", sa.Text),  # the name its tenant gave it
    # What a tenant's own template holds on its worker (its checkpoint's size): counted in the
    # tenant's checkpoint quotas.
    sa.Column("held_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Index("templates_tenant", "tenant_id", "created_at"),
)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),  # active | dead
    sa.Column("instance", sa.Text, nullable=False),  # changes at every worker process start
    sa.Column("capacity_vcpus", sa.Integer, nullable=False),
    sa.Column("capacity_memory_mib", sa.Integer, nullable=False),
    sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("mem_available_mib", sa.Integer),  # the host's MemAvailable at its last probe
    # The templates it holds (name: digest of its newest build), as its last probe said.
    sa.Column("templates", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # Being drained (`space admin drain`): no new work; its sandboxes are moved off it.
    sa.Column("draining", sa.Boolean, nullable=False, server_default=sa.false()),
    # It pushes to the deployment's registry (its probes say): its sandboxes can move.
    sa.Column("registry", sa.Boolean, nullable=False, server_default=sa.false()),
    # What one sandbox may take of its disk and network (its probes say; 0: no limit).
    sa.Column("shares", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    # Its release (space.release), as it registered and its probes say.
    sa.Column("version", sa.Text, nullable=False, server_default="0.1.0"),
    sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    # From its health probes: what each VMM costs beyond its guest's RAM, what its disks may
    # still take, and why it takes no work if it does not (its gateway is down, …).
    sa.Column("overhead_mib", sa.Integer, nullable=False, server_default="0"),
    sa.Column("capacity_disk_mib", sa.Integer, nullable=False, server_default="0"),
    sa.Column("used_disk_mib", sa.Integer, nullable=False, server_default="0"),
    sa.Column("problem", sa.Text),
    sa.Column("used_memory_mib", sa.Integer),  # measured by the worker (PSS), at measured_at
    sa.Column("measured_at", sa.DateTime(timezone=True)),
)

sandboxes = sa.Table(
    "sandboxes",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("template", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("desired_state", sa.Text, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column("prev_state", sa.Text),  # what `error` interrupted, to return to when recoverable
    sa.Column("worker_id", sa.Text, sa.ForeignKey("workers.id")),
    sa.Column("vcpus", sa.Integer, nullable=False),
    sa.Column("memory_mib", sa.Integer, nullable=False),
    sa.Column("disk_mib", sa.Integer, nullable=False),
    sa.Column("timeout_s", sa.Integer, nullable=False),
    sa.Column("timeout_action", sa.Text, nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True)),
    sa.Column("env", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("metadata", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("idempotency_key", sa.Text),
    # [{"volume": id, "path": "/data", "read_only": false}]: where its volumes are mounted
    sa.Column("volumes", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
    # Egress policy (null: the deployment's default) and bound secrets, each with the
    # placeholder its guest sees instead of the value (never the value itself).
    sa.Column("network", JSONB),
    sa.Column("secrets", JSONB, nullable=False, server_default=sa.text("'[]'::jsonb")),
    # A warm-pool member: owned by POOL_TENANT until a create claims it.
    sa.Column("pool", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("boot", sa.Text),  # how it came to run first: pool, restore or cold
    # While suspended: where its snapshot is in the registry, so any worker can resume it.
    sa.Column("artifact", sa.Text),
    # Egress policy changes: the API bumps the version, the controller pushes it to the worker
    # and records the version in force there.
    sa.Column("network_version", sa.Integer, nullable=False, server_default="0"),
    sa.Column("network_applied", sa.Integer, nullable=False, server_default="0"),
    # A warm-pool member being handed over (state `claiming`): the claim that holds it.
    sa.Column("claim_token", sa.Text),
    # The API request that asked for its current desired state (null: the platform's own
    # doing), so the controller's log lines for the steps it takes name that request.
    sa.Column("request_id", sa.Text),
    # The trace of that request (W3C traceparent): the controller's work joins it (space.tracing).
    sa.Column("trace_parent", sa.Text),
    sa.Column("idle_timeout_s", sa.Integer),  # paused after this long without use; None: never
    sa.Column("active_at", sa.DateTime(timezone=True)),  # its last exec, file call or ingress
    sa.Column("idle_paused", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index(
        "sandboxes_tenant_created", "tenant_id", sa.text("created_at DESC"), sa.text("id DESC")
    ),
    sa.Index("sandboxes_state", "state"),
    sa.Index("sandboxes_worker", "worker_id"),
    sa.Index("sandboxes_metadata", "metadata", postgresql_using="gin"),
    sa.Index(
        "sandboxes_pool",
        "template",
        "vcpus",
        "memory_mib",
        "disk_mib",
        "created_at",
        postgresql_where=sa.text("pool"),
    ),
    sa.Index(
        "sandboxes_idempotency",
        "tenant_id",
        "idempotency_key",
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    ),
)

secrets = sa.Table(
    "secrets",
    metadata,
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), primary_key=True),
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("key_id", sa.Text, nullable=False),  # which sealing key encrypted it
    sa.Column("sealed", sa.LargeBinary, nullable=False),  # nonce + AES-GCM ciphertext
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
)

volumes = sa.Table(
    "volumes",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("name", sa.Text, nullable=False, server_default=""),
    sa.Column("size_mib", sa.Integer, nullable=False),
    sa.Column("state", sa.Text, nullable=False),  # available | deleting | deleted
    # The worker whose host holds its image, from its first attachment on.
    sa.Column("worker_id", sa.Text, sa.ForeignKey("workers.id")),
    # Detached, its image as it is now in the registry: its next sandbox may run on any worker.
    sa.Column("artifact", sa.Text),
    # One more each time a sandbox starts with it: a push begun before is out of date.
    sa.Column("generation", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("volumes_tenant", "tenant_id", "created_at"),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("sandbox_id", sa.Text, sa.ForeignKey("sandboxes.id"), nullable=False),
    # On the worker of its sandbox (memory, devices, disk): checkpoints/<sandbox>/<id>.
    sa.Column("worker_id", sa.Text, sa.ForeignKey("workers.id"), nullable=False),
    sa.Column("name", sa.Text, nullable=False, server_default=""),
    sa.Column("state", sa.Text, nullable=False),  # creating | ready | deleting
    sa.Column("size_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("paused_ms", sa.Float),  # how long the guest was stopped for it
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("checkpoints_sandbox", "sandbox_id", "created_at"),
    sa.Index("checkpoints_tenant", "tenant_id"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
    sa.Column("sandbox_id", sa.Text, nullable=False),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("from_state", sa.Text),
    sa.Column("to_state", sa.Text),
    sa.Column("reason", sa.Text),
    sa.Index("events_sandbox", "sandbox_id", "id"),
)

template_builds = sa.Table(
    "template_builds",
    metadata,
    # A build asked for and not yet started on a worker (the controller starts it).
    sa.Column("template_id", sa.Text, sa.ForeignKey("templates.id"), primary_key=True),
    sa.Column("request_id", sa.Text, nullable=False),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("context", sa.LargeBinary, nullable=False),
    # Registry credentials for this build, sealed like secrets; removed with the request.
    sa.Column("environ_key_id", sa.Text),
    sa.Column("environ_sealed", sa.LargeBinary),
    # Or the checkpoint the template is made of (spec and context are then empty). No foreign
    # key: a checkpoint deleted before the build starts fails the build, it does not vanish it.
    sa.Column("checkpoint_id", sa.Text),
    sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("tenant_id", sa.Text),  # whose key asked (told when it ends)
)

# Files E2B's template builder uploads for its COPY steps (e2b/templates.py): asked for with
# a token the upload's URL carries, then the gzipped tar itself.
e2b_uploads = sa.Table(
    "e2b_uploads",
    metadata,
    sa.Column("tenant_id", sa.Text, primary_key=True),
    sa.Column("hash", sa.Text, primary_key=True),
    sa.Column("token_sha256", sa.LargeBinary, nullable=False),
    sa.Column("data", sa.LargeBinary),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
)

# Sandboxes a worker holds that no row has ever named (db/store/strays.py).
strays = sa.Table(
    "strays",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("worker_id", sa.Text, nullable=False),
    sa.Column("found_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("discarded", sa.Boolean, nullable=False, server_default=sa.false()),
)

# Every call that changed something through the control plane, or tried to (db/store/audit.py).
# Append-only: a trigger refuses UPDATE, DELETE and TRUNCATE (migration 0016).
audit_log = sa.Table(
    "audit_log",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("tenant_id", sa.Text),  # no foreign key: the trail outlives what it names
    sa.Column("key_id", sa.Text),
    sa.Column("admin", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("method", sa.Text, nullable=False),
    sa.Column(
        "action", sa.Text, nullable=False
    ),  # the route: "POST /v1/sandboxes/{sandbox_id}/pause"
    sa.Column("path", sa.Text, nullable=False),
    sa.Column("params", JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
    sa.Column("created", sa.Text),  # the id of what the call made, when it answered one
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("request_id", sa.Text),
    sa.Column("remote", sa.Text),
    sa.Index("audit_log_tenant", "tenant_id", "id"),
)

# Metering (db/store/usage.py): figures that add up, by name and column type.
USAGE_FIGURES = {
    "seconds": sa.Float,  # in the state
    "vcpu_seconds": sa.Float,  # vCPUs given, times seconds
    "memory_gib_seconds": sa.Float,  # guest RAM given, times seconds
    "cpu_seconds": sa.Float,  # the host's CPU time, measured on its VMM
    "disk_gib_hours": sa.Float,  # allocated on the pool by its disk
    "snapshot_gib_hours": sa.Float,  # by its suspended snapshot
    "checkpoint_gib_hours": sa.Float,  # by its checkpoints
    "volume_gib_hours": sa.Float,  # a volume's size
    "net_rx_bytes": sa.BigInteger,  # its NIC's counters
    "net_tx_bytes": sa.BigInteger,
    "egress_bytes": sa.BigInteger,  # what its gateway sent on to origins
    "ingress_bytes": sa.BigInteger,  # and received from them
}


def _figures() -> list[sa.Column[object]]:
    return [
        sa.Column(n, kind, nullable=False, server_default="0") for n, kind in USAGE_FIGURES.items()
    ]


# What each sandbox (or volume) used per bucket of `step_s` seconds in one state: running,
# paused, suspended, or stored (checkpoints, volumes). Rolled up into hours once old.
usage = sa.Table(
    "usage",
    metadata,
    sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
    sa.Column("step_s", sa.Integer, nullable=False),
    sa.Column("tenant_id", sa.Text, nullable=False),  # no foreign key: usage outlives tenants
    sa.Column("subject", sa.Text, nullable=False),  # a sandbox's id, or a volume's
    sa.Column("kind", sa.Text, nullable=False),  # sandbox | volume
    sa.Column("template", sa.Text, nullable=False, server_default=""),
    sa.Column("state", sa.Text, nullable=False),
    *_figures(),
    sa.PrimaryKeyConstraint("subject", "bucket", "step_s", "state", "tenant_id"),
    sa.Index("usage_tenant", "tenant_id", "bucket"),
    sa.Index("usage_bucket", "bucket"),
)

# A sandbox's bytes through its gateway by host, per bucket.
usage_traffic = sa.Table(
    "usage_traffic",
    metadata,
    sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
    sa.Column("step_s", sa.Integer, nullable=False),
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("sandbox_id", sa.Text, nullable=False),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("sent", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("received", sa.BigInteger, nullable=False, server_default="0"),
    sa.PrimaryKeyConstraint("sandbox_id", "bucket", "step_s", "host", "tenant_id"),
    sa.Index("usage_traffic_tenant", "tenant_id", "bucket"),
    sa.Index("usage_traffic_bucket", "bucket"),
)

# Up to when the time sandboxes spent in each state has been counted (one row): the next round
# counts from there, whichever leader runs it.
usage_cursor = sa.Table(
    "usage_cursor",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("until", sa.DateTime(timezone=True), nullable=False),
)

# Each tenant's figures since metering began, by state: they only grow (Prometheus counters).
usage_totals = sa.Table(
    "usage_totals",
    metadata,
    sa.Column("tenant_id", sa.Text, nullable=False),
    sa.Column("state", sa.Text, nullable=False),
    *_figures(),
    sa.PrimaryKeyConstraint("tenant_id", "state"),
)

# Lifecycle webhooks (space.webhooks): a tenant's endpoints, what is owed to each, every try.
webhooks = sa.Table(
    "webhooks",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenants.id"), nullable=False),
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("events", JSONB, nullable=False),  # the event types it wants
    sa.Column("description", sa.Text, nullable=False, server_default=""),
    sa.Column("key_id", sa.Text, nullable=False),  # of the sealing key of its signing secret
    sa.Column("sealed_secret", sa.LargeBinary, nullable=False),
    sa.Column("after_event", sa.BigInteger, nullable=False),  # it is owed only later events
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Index("webhooks_tenant", "tenant_id"),
)

webhook_deliveries = sa.Table(
    "webhook_deliveries",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column(
        "webhook_id", sa.Text, sa.ForeignKey("webhooks.id", ondelete="CASCADE"), nullable=False
    ),
    sa.Column("event_id", sa.BigInteger, nullable=False),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("payload", JSONB, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("next_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    # delivered (a 2xx), failed (retried for a day and given up), or pending
    sa.Column("state", sa.Text, nullable=False, server_default="pending"),
    sa.UniqueConstraint("webhook_id", "event_id", "type"),
    sa.Index("webhook_deliveries_due", "state", "next_at"),
)

webhook_attempts = sa.Table(
    "webhook_attempts",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column(
        "delivery_id",
        sa.BigInteger,
        sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
        nullable=False,
    ),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("status", sa.Integer),  # the endpoint's answer; null: none came
    sa.Column("error", sa.Text),
    sa.Column("ms", sa.Float, nullable=False),
    sa.Index("webhook_attempts_delivery", "delivery_id"),
)

# How far the leader has read `events` for webhooks (one row).
webhook_cursor = sa.Table(
    "webhook_cursor",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("event_id", sa.BigInteger, nullable=False),
)

leases = sa.Table(
    "leases",
    metadata,
    # Leadership: whoever holds an unexpired row leads; `epoch` grows at every new holder and
    # fences the calls of holders that lost it.
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
)

join_tokens = sa.Table(
    "join_tokens",
    metadata,
    # One-time tokens a worker trades for its certificate (`space admin join-token`); only
    # their hash is kept, and a token is bound to the one worker id it was made for.
    sa.Column("token_sha256", sa.LargeBinary, primary_key=True),
    sa.Column("worker_id", sa.Text, nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=NOW),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("used_at", sa.DateTime(timezone=True)),
)

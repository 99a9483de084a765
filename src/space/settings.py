"""Deployment settings: read once from the environment into one typed object, passed down.

Every `SPACE_*` variable a service reads is here, with its default for one machine; a process
calls `Settings.from_env()` once at start and hands the parts to what it builds. A value that
does not parse stops the process with a message naming the variable.

Secrets that are not set (the worker secret, the keys that seal tenants' secrets) are made once
and kept in the state directory (mode 0600), so every process of a one-machine deployment shares
them; `Settings` only says where, `load_*` reads them.
"""

from __future__ import annotations

import base64
import os
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from space import paths
from space.networks import openable
from space.quotas import Quotas

T = TypeVar("T")
LOG_LEVELS = ("debug", "info", "warning", "error")


class SettingsError(ValueError):
    """A setting that does not parse; the message names the variable."""


class _Env:
    """Typed reads of one environment mapping; each names its variable when it fails."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def text(self, name: str, default: str = "") -> str:
        value: str = self.env.get(name) or default
        return value

    def integer(self, name: str, default: int, low: int | None = 0) -> int:
        return self._parse(name, default, int, low)

    def number(self, name: str, default: float, low: float | None = 0.0) -> float:
        return self._parse(name, default, float, low)

    def flag(self, name: str, default: bool) -> bool:
        raw = self.env.get(name)
        if raw is None or raw == "":
            return default
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name} must be 0 or 1, not {raw!r}")

    def choice(self, name: str, default: str, allowed: tuple[str, ...]) -> str:
        value: str = self.env.get(name) or default
        if value not in allowed:
            raise SettingsError(f"{name} must be one of {', '.join(allowed)}, not {value!r}")
        return value

    def domain(self, name: str, default: str) -> str:
        value = self.text(name, default).strip().strip(".").lower()
        labels = value.split(".")
        if not all(re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", x) for x in labels):
            raise SettingsError(f"{name} must be a DNS name such as preview.example.com")
        return value

    def networks(self, name: str) -> tuple[str, ...]:
        """A comma-separated list of private networks an operator may open to sandboxes."""
        raw = [n.strip() for n in self.text(name).split(",") if n.strip()]
        try:
            return tuple(openable(raw))
        except ValueError as err:
            raise SettingsError(f"{name}: {err}") from None

    def _parse(self, name: str, default: T, kind: Callable[[str], T], low: T | None) -> T:
        raw = self.env.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            value = kind(raw.strip())
        except ValueError:
            raise SettingsError(f"{name} must be a number, not {raw!r}") from None
        if low is not None and value < low:  # type: ignore[operator]
            raise SettingsError(f"{name} must be at least {low}, not {raw!r}")
        return value


@dataclass(frozen=True)
class APISettings:
    host: str = "127.0.0.1"
    port: int = 8080
    # /metrics needs `Authorization: Bearer <token>` when set (`space up` always sets one).
    metrics_token: str = ""
    # Requests per second each tenant may make of one API process, and the burst it may save
    # up; past them, 429 with Retry-After. 0: no limit.
    rate_limit: float = 50.0
    rate_burst: int = 200
    # Preview hosts: `{port}-{sandbox}.{domain}` on the API's port is that sandbox's port at
    # an origin of its own. Browsers resolve every `*.localhost` name to this machine.
    preview_domain: str = "localhost"


@dataclass(frozen=True)
class ControllerSettings:
    metrics_address: str = ""  # host:port of the controller's Prometheus endpoint; "" for none
    # A worker that has not answered a health probe for this long is lost.
    worker_lost_after_s: float = 8.0
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0
    # The leader's lease: renewed every third of it; a leader that cannot renew in time stops
    # acting, and another replica takes over once it expires.
    lease_ttl_s: float = 10.0
    # A pool claim the API did not confirm within this long is abandoned (its member dropped).
    claim_grace_s: float = 15.0
    # How often the leader compares workers' VMs with the database and deletes what is gone.
    gc_interval_s: float = 15.0
    # Metering: how often sandboxes are measured, and the width of a usage bucket; buckets
    # older than `usage_fine_days` are rolled up into hours.
    usage_resolution_s: int = 60
    usage_fine_days: float = 7.0


@dataclass(frozen=True)
class PoolSettings:
    refill_concurrency: int = 2  # members of one pool being made at once
    reserve_mib: int = 1024  # below this MemAvailable on a worker's host, its members go


@dataclass(frozen=True)
class GatewayEnv:
    upstream_dns: str = ""  # HOST[:PORT]; "" for the host's resolver
    upstream_ca: Path | None = None  # CAs that verify origins where TLS is terminated
    # The deployment's CA (ca.pem, ca.key) that gateways sign intercepted TLS with, so every
    # worker's sandboxes trust the same one; None: each gateway makes its own once.
    ca_dir: Path | None = None
    user: str = "nobody"  # the gateway drops root to this user


ADMIT_MEMORY = ("measured", "guest")


@dataclass(frozen=True)
class RegistrySettings:
    """The OCI registry that templates, snapshots of suspended sandboxes and volumes are pushed
    to, so that any worker can run them; "" (the default): each stays on the host that made it."""

    url: str = ""  # host[:port]/prefix
    insecure: bool = False  # plain HTTP: only for a registry on this host or a private address
    username: str = ""
    password: str = field(default="", repr=False)


@dataclass(frozen=True)
class JailSettings:
    """How VMMs are confined (`worker/vmm/jail/`)."""

    enabled: bool = True  # off: VMMs run as the worker's root (a baseline for benchmarks)
    # Each VMM runs as a uid (and gid) of its own from [uid_base, uid_base + uid_count), shared
    # by every worker of the host.
    uid_base: int = 1_500_000_000
    uid_count: int = 65_536
    # The VMM's cgroup: twice the guest's RAM (its snapshot streams' page cache) plus this for
    # the VMM itself (TCG's code cache, device buffers), a cap on its threads, and CPU time up
    # to its vCPUs plus `extra_cpus`.
    memory_overhead_mib: int = 256
    pids: int = 160
    extra_cpus: float = 1.0


@dataclass(frozen=True)
class Shares:
    """What one sandbox may take of its host's disk and network, so a neighbour flooding either
    leaves the others their share (0: no limit). Disk: all its drives together, reads and
    writes together; network: each way, through its tap."""

    disk_mib_s: int = 64
    disk_iops: int = 1000
    net_mbit: int = 200


@dataclass(frozen=True)
class WorkerSettings:
    driver: Literal["qemu", "firecracker"] = "qemu"
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    guest_aslr: bool = False  # under TCG guests run without ASLR unless this is set
    vcpus: int = 0  # capacity; 0: vcpu_overcommit per host core
    vcpu_overcommit: float = 64.0  # vCPUs admitted per host core (idle ones cost little)
    memory_mib: int = 0  # capacity; 0: three quarters of the host's memory
    # measured: live VMs count what their VMMs take (PSS); guest: their whole guest RAM.
    admit_memory: Literal["measured", "guest"] = "measured"
    # on: ksmd merges what clones share (57 against 150 MiB each, for some CPU and slower first
    # touches: bench/density.py); host: leave the kernel's KSM settings alone.
    ksm: Literal["on", "off", "host"] = "off"
    ksm_pages_to_scan: int = 2000  # pages ksmd scans per wake-up (every ksm_sleep_ms)
    ksm_sleep_ms: int = 20
    # Guests booted with a balloon that gives back the pages they free (bench/density.py).
    free_page_reporting: bool = True
    # Base snapshots keep guest RAM as a file that restores map on demand, clones sharing what
    # they have not written (they then have no balloon: QEMU would punch holes in that file).
    mapped_memory: bool = True
    base_snapshots: bool = True
    network: bool = True  # off: VMs have no NIC at all
    net_range: str = ""  # the /16 its sandboxes' host ends come from; "" to pick a free one
    pool_dir: Path | None = None  # an existing btrfs/XFS directory instead of the pool image
    pool_image_gib: int = 64
    # Memory the host keeps for what is not a sandbox: template builds, the gateway, the worker.
    reserve_mib: int = 1024
    # host:port of the worker's Prometheus endpoint (per-sandbox figures); "" for none.
    metrics_address: str = ""
    # Mutual TLS with the control plane: the worker serves HTTPS with a certificate of its own,
    # got once by trading the token in `join_token_file` at the API (`control_url`) and kept
    # in its directory.
    tls: bool = False
    join_token_file: Path | None = None
    control_url: str = ""
    registry: RegistrySettings = field(default_factory=RegistrySettings)
    jail: JailSettings = field(default_factory=JailSettings)
    shares: Shares = field(default_factory=Shares)
    gateway: GatewayEnv = field(default_factory=GatewayEnv)


@dataclass(frozen=True)
class LogSettings:
    format: Literal["text", "json"] = "text"  # json: one object a line, with its request
    level: str = "warning"  # info: a line per request and per step a sandbox takes


@dataclass(frozen=True)
class Settings:
    state_dir: Path = Path("/var/lib/space")
    cache_dir: Path = Path("/var/cache/space")
    database_url: str = ""  # "" for the embedded server in the state directory
    worker_secret: str = ""  # "" for one made in the state directory
    # The worker CA (ca.pem, ca.key), held by the API and controller only: with it they issue
    # workers' certificates and call workers over mutual TLS. None: plain HTTP to workers.
    worker_ca_dir: Path | None = None
    secrets_keys: str = ""  # "" for a key made in the state directory
    # An OpenTelemetry collector's OTLP/HTTP address: every service sends its spans there
    # (space.tracing); "" for none.
    otlp_endpoint: str = ""
    egress_default: Literal["deny", "allow"] = "deny"
    # Private networks (an internal service) an operator lets sandbox policies reach; loopback,
    # link-local (cloud metadata) and the sandboxes' own ranges can never be opened.
    egress_open_networks: tuple[str, ...] = ()
    # Private networks webhook endpoints may be in (space.webhooks.targets): none by default.
    webhook_open_networks: tuple[str, ...] = ()
    quotas: Quotas = field(default_factory=Quotas)  # each tenant's, unless overridden
    # Sandboxes that do not choose are paused after this many seconds unused (0: never).
    idle_timeout_s: int = 0
    crash_at: str = ""  # a step of `space.crashpoints` to die at (fault-injection tests only)
    api: APISettings = field(default_factory=APISettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    pools: PoolSettings = field(default_factory=PoolSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    log: LogSettings = field(default_factory=LogSettings)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        e = _Env(env)
        ca = e.text("SPACE_GATEWAY_UPSTREAM_CA")
        pool_dir = e.text("SPACE_POOL_DIR")
        ca_dir = e.text("SPACE_GATEWAY_CA_DIR")
        worker_ca = e.text("SPACE_WORKER_CA_DIR")
        token_file = e.text("SPACE_WORKER_JOIN_TOKEN_FILE")
        return cls(
            state_dir=paths.state_dir(env),
            cache_dir=paths.cache_dir(env),
            database_url=e.text("SPACE_DATABASE_URL"),
            worker_secret=e.text("SPACE_WORKER_SECRET"),
            worker_ca_dir=Path(worker_ca) if worker_ca else None,
            secrets_keys=e.text("SPACE_SECRETS_KEYS"),
            otlp_endpoint=e.text("SPACE_OTLP_ENDPOINT"),
            egress_default=e.choice("SPACE_EGRESS_DEFAULT", "deny", ("deny", "allow")),  # type: ignore[arg-type]
            egress_open_networks=e.networks("SPACE_EGRESS_OPEN_NETWORKS"),
            webhook_open_networks=e.networks("SPACE_WEBHOOK_OPEN_NETWORKS"),
            quotas=Quotas(
                **{
                    name: e.integer(f"SPACE_QUOTA_{name.upper()}", default)
                    for name, default in Quotas().as_dict().items()
                }
            ),
            crash_at=e.text("SPACE_CRASH_AT"),
            idle_timeout_s=e.integer("SPACE_IDLE_TIMEOUT", 0),
            api=APISettings(
                host=e.text("SPACE_API_HOST", "127.0.0.1"),
                port=e.integer("SPACE_API_PORT", 8080, low=1),
                metrics_token=e.text("SPACE_METRICS_TOKEN"),
                rate_limit=e.number("SPACE_RATE_LIMIT", 50.0),
                rate_burst=e.integer("SPACE_RATE_BURST", 200, low=1),
                preview_domain=e.domain("SPACE_PREVIEW_DOMAIN", "localhost"),
            ),
            controller=ControllerSettings(
                metrics_address=e.text("SPACE_CONTROLLER_METRICS"),
                worker_lost_after_s=e.number("SPACE_WORKER_LOST_AFTER", 8.0, low=1.0),
                lease_ttl_s=e.number("SPACE_LEASE_TTL", 10.0, low=1.0),
                claim_grace_s=e.number("SPACE_CLAIM_GRACE", 15.0, low=1.0),
                gc_interval_s=e.number("SPACE_GC_INTERVAL", 15.0, low=1.0),
                usage_resolution_s=e.integer("SPACE_USAGE_RESOLUTION", 60, low=1),
                usage_fine_days=e.number("SPACE_USAGE_FINE_DAYS", 7.0, low=0.0),
            ),
            pools=PoolSettings(
                refill_concurrency=e.integer("SPACE_POOL_REFILL_CONCURRENCY", 2, low=1),
                reserve_mib=e.integer("SPACE_POOL_RESERVE_MIB", 1024),
            ),
            worker=WorkerSettings(
                driver=e.choice("SPACE_WORKER_DRIVER", "qemu", ("qemu", "firecracker")),  # type: ignore[arg-type]
                accel=e.choice("SPACE_ACCEL", "auto", ("auto", "kvm", "tcg")),  # type: ignore[arg-type]
                guest_aslr=e.flag("SPACE_GUEST_ASLR", False),
                vcpus=e.integer("SPACE_WORKER_VCPUS", 0),
                vcpu_overcommit=e.number("SPACE_WORKER_VCPU_OVERCOMMIT", 64.0, low=0.1),
                memory_mib=e.integer("SPACE_WORKER_MEMORY_MIB", 0),
                admit_memory=e.choice(
                    "SPACE_WORKER_ADMIT_MEMORY", "measured", ("measured", "guest")
                ),  # type: ignore[arg-type]
                ksm=e.choice("SPACE_WORKER_KSM", "off", ("on", "off", "host")),  # type: ignore[arg-type]
                ksm_pages_to_scan=e.integer("SPACE_WORKER_KSM_PAGES", 2000, low=1),
                ksm_sleep_ms=e.integer("SPACE_WORKER_KSM_SLEEP_MS", 20, low=1),
                free_page_reporting=e.flag("SPACE_WORKER_FREE_PAGE_REPORTING", True),
                mapped_memory=e.flag("SPACE_WORKER_MAPPED_MEMORY", True),
                base_snapshots=e.flag("SPACE_WORKER_BASE_SNAPSHOTS", True),
                network=e.flag("SPACE_WORKER_NETWORK", True),
                net_range=e.text("SPACE_WORKER_NET_RANGE"),
                pool_dir=Path(pool_dir) if pool_dir else None,
                pool_image_gib=e.integer("SPACE_POOL_IMAGE_GIB", 64, low=1),
                reserve_mib=e.integer("SPACE_WORKER_RESERVE_MIB", 1024),
                metrics_address=e.text("SPACE_WORKER_METRICS"),
                tls=e.flag("SPACE_WORKER_TLS", False),
                join_token_file=Path(token_file) if token_file else None,
                control_url=e.text("SPACE_CONTROL_URL"),
                jail=JailSettings(
                    enabled=e.flag("SPACE_WORKER_JAIL", True),
                    uid_base=e.integer("SPACE_WORKER_JAIL_UID_BASE", 1_500_000_000, low=1),
                    uid_count=e.integer("SPACE_WORKER_JAIL_UIDS", 65_536, low=1),
                    memory_overhead_mib=e.integer(
                        "SPACE_WORKER_JAIL_MEMORY_OVERHEAD_MIB", 256, low=64
                    ),
                    pids=e.integer("SPACE_WORKER_JAIL_PIDS", 160, low=32),
                    extra_cpus=e.number("SPACE_WORKER_JAIL_EXTRA_CPUS", 1.0, low=0.0),
                ),
                shares=Shares(
                    disk_mib_s=e.integer("SPACE_WORKER_DISK_MIB_S", 64, low=0),
                    disk_iops=e.integer("SPACE_WORKER_DISK_IOPS", 1000, low=0),
                    net_mbit=e.integer("SPACE_WORKER_NET_MBIT", 200, low=0),
                ),
                registry=RegistrySettings(
                    url=e.text("SPACE_REGISTRY"),
                    insecure=e.flag("SPACE_REGISTRY_INSECURE", False),
                    username=e.text("SPACE_REGISTRY_USERNAME"),
                    password=e.text("SPACE_REGISTRY_PASSWORD"),
                ),
                gateway=GatewayEnv(
                    upstream_dns=e.text("SPACE_GATEWAY_UPSTREAM_DNS"),
                    upstream_ca=Path(ca) if ca else None,
                    ca_dir=Path(ca_dir) if ca_dir else None,
                    user=e.text("SPACE_GATEWAY_USER", "nobody"),
                ),
            ),
            log=LogSettings(
                format=e.choice("SPACE_LOG_FORMAT", "text", ("text", "json")),  # type: ignore[arg-type]
                level=e.choice("SPACE_LOG_LEVEL", "warning", LOG_LEVELS),
            ),
        )

    # --- values kept in the state directory ---------------------------------------------------

    def state_secret_path(self, name: str) -> Path:
        return self.state_dir / name

    def load_worker_secret(self) -> str:
        """The secret the API and controller present to workers."""
        return self.worker_secret or self._state_secret(
            "worker-secret", lambda: secrets.token_urlsafe(32)
        )

    def load_metrics_token(self) -> str:
        """The bearer token /metrics asks for (SPACE_METRICS_TOKEN, or one made once)."""
        return self.api.metrics_token or self._state_secret(
            "metrics-token", lambda: secrets.token_urlsafe(24)
        )

    def load_sealing_keys(self) -> list[tuple[str, bytes]]:
        """The keys that encrypt secrets at rest, newest first: (key id, 32 bytes).

        SPACE_SECRETS_KEYS is "id:base64,id:base64,..." (a rotation puts a new key first; older
        ones stay until nothing is sealed with them)."""
        text = self.secrets_keys or self._state_secret("secrets-keys", new_sealing_key)
        keys = []
        for item in text.replace("\n", ",").split(","):
            if item.strip():
                kid, _, b64 = item.strip().partition(":")
                key = base64.b64decode(b64)
                if not kid or len(key) != 32:
                    raise SettingsError("SPACE_SECRETS_KEYS: each key is id:base64 of 32 bytes")
                keys.append((kid, key))
        if not keys:
            raise SettingsError("no key to seal secrets with")
        return keys

    def _state_secret(self, name: str, make: Callable[[], str]) -> str:
        path = self.state_secret_path(name)
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic: of two processes racing here, exactly one value wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
        return path.read_text().strip()


def new_sealing_key() -> str:
    return f"k{secrets.token_hex(4)}:{base64.b64encode(secrets.token_bytes(32)).decode()}"

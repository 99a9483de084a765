"""What the public API accepts and answers (pydantic models; they make the OpenAPI document)."""

from __future__ import annotations

import posixpath
import re
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from space.netpolicy import NetworkPolicy, SecretBinding
from space.webhooks.events import EVENT_TYPES
from space.worker.api.models import MAX_CONTEXT_B64, check_build_source, check_tag
from space.worker.templates.dockerfile import MAX_VALUE_BYTES

ID_PATTERN = r"^[a-z0-9][a-z0-9-]{2,39}$"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
MAX_ENTRIES = 64

TimeoutAction = Literal["pause", "suspend", "delete"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FromRow(BaseModel):
    """An answer made of the database row's columns of the same names."""

    @classmethod
    def from_row(cls, row: Any) -> Self:
        return cls.model_validate({k: row[k] for k in cls.model_fields})


def _check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENTRIES:
        raise ValueError(f"at most {MAX_ENTRIES} variables")
    for name, value in env.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"{name!r} is not a valid variable name")
        if "\0" in value or len(value) > 32768:
            raise ValueError(f"the value of {name} has a NUL byte or is over 32 KiB")
    return env


# Mounting over these would break the guest (its agent lives in /run/space).
RESERVED_MOUNTS = ("/proc", "/sys", "/dev", "/run")


class VolumeAttach(Strict):
    volume: str = Field(min_length=1, max_length=64, description="a volume id")
    path: str = Field(min_length=2, max_length=1024, description="absolute mount path")
    read_only: bool = False

    @field_validator("path")
    @classmethod
    def mount_path(cls, path: str) -> str:
        clean = posixpath.normpath(path)
        if not path.startswith("/") or clean == "/" or "\0" in path:
            raise ValueError("must be an absolute path other than /")
        if any(clean == r or clean.startswith(r + "/") for r in RESERVED_MOUNTS):
            raise ValueError(f"may not be under {', '.join(RESERVED_MOUNTS)}")
        return clean


ChosenId = Annotated[
    str,
    Field(
        pattern=ID_PATTERN,
        description="your name for it; the sandbox's id is this and a tag of your tenant "
        "(the same every time), so a repeat finds the same sandbox",
    ),
]


class SandboxCreate(Strict):
    template: str = Field("base", min_length=1, max_length=64)
    vcpus: int = Field(1, ge=1, le=16)
    memory_mib: int = Field(256, ge=128, le=16384)
    disk_mib: int = Field(
        1024,
        ge=256,
        le=262144,
        description="default: 1024, or the template's file system size where that is larger",
    )
    timeout_s: int = Field(300, ge=1, le=7 * 24 * 3600)
    timeout_action: TimeoutAction = "pause"
    idle_timeout_s: int | None = Field(
        None, ge=0, le=7 * 24 * 3600,
        description="pause it after this many seconds with no exec, file call or ingress (an "
        "open stream counts as use); its next such call resumes it. 0: never; null: the "
        "deployment's default",
    )  # fmt: skip
    env: dict[str, str] = Field(default_factory=dict)
    metadata: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=512)]] = (
        Field(default_factory=dict)
    )
    id: ChosenId | None = None
    volumes: list[VolumeAttach] = Field(
        default_factory=list, max_length=2, description="volumes to mount (at most 2)"
    )
    network: NetworkPolicy | None = Field(
        None, description="egress policy; null: the deployment's default (deny unless set)"
    )
    secrets: list[SecretBinding] = Field(
        default_factory=list, max_length=16,
        description="your secrets the gateway may send, and to which hosts; the guest never "
        "sees their values",
    )  # fmt: skip

    @field_validator("env")
    @classmethod
    def env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)

    @model_validator(mode="after")
    def placeholders_apart(self) -> SandboxCreate:
        names = [b.env for b in self.secrets if b.env]
        if len(set(names)) != len(names) or set(names) & set(self.env):
            raise ValueError("each secret's env variable must be its own, not also in env")
        if any(b.placeholder for b in self.secrets):
            raise ValueError("placeholders are chosen by SPACE")
        return self

    @field_validator("volumes")
    @classmethod
    def distinct_volumes(cls, volumes: list[VolumeAttach]) -> list[VolumeAttach]:
        if len({v.volume for v in volumes}) != len(volumes):
            raise ValueError("a volume may be attached once")
        if len({v.path for v in volumes}) != len(volumes):
            raise ValueError("each volume needs a mount path of its own")
        return volumes

    @field_validator("metadata")
    @classmethod
    def few_metadata(cls, md: dict[str, str]) -> dict[str, str]:
        if len(md) > MAX_ENTRIES:
            raise ValueError(f"at most {MAX_ENTRIES} metadata entries")
        return md


class Sandbox(FromRow):
    id: str
    state: str
    desired_state: str
    reason: str | None
    template: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    timeout_s: int
    timeout_action: str
    expires_at: datetime | None
    idle_timeout_s: int | None = Field(description="paused after this long unused; null: never")
    env: dict[str, str]
    metadata: dict[str, str]
    worker_id: str | None
    created_at: datetime
    updated_at: datetime
    volumes: list[VolumeAttach]
    network: NetworkPolicy | None
    secrets: list[SecretBinding] = Field(
        description="bound secrets, each with the placeholder its guest sees (never the value)"
    )
    boot: Literal["pool", "restore", "cold", "fork"] | None = Field(
        description="how it first came to run: claimed from the warm pool, restored from the "
        "template's base snapshot, booted, or forked from another sandbox; null until it runs"
    )


class PoolSettings(Strict):
    size: int = Field(ge=0, le=1000, description="members to keep ready; 0 turns the pool off")
    vcpus: int = Field(1, ge=1, le=16)
    memory_mib: int = Field(256, ge=128, le=16384)
    disk_mib: int = Field(1024, ge=256, le=262144)


class Pool(PoolSettings):
    ready: int = Field(description="members running and waiting to be claimed")
    starting: int = Field(description="members on their way")


class Built(BaseModel):
    """What the last successful build made."""

    digest: str
    source: str
    size_bytes: int
    env: dict[str, str]
    workdir: str | None
    user: str | None
    entrypoint: list[str]
    cmd: list[str]
    start: str | None
    ready: str | None
    steps: list[str]
    built_at: str
    build_seconds: float
    vcpus: int | None = Field(None, description="made of a checkpoint: its sandboxes' vCPUs")
    memory_mib: int | None = Field(None, description="made of a checkpoint: their memory")
    artifact: str | None = Field(
        None, description="where the build is in the deployment's registry (any worker runs "
        "it); none: it runs only on the worker that built it"
    )  # fmt: skip


class Template(BaseModel):
    id: str
    state: Literal["queued", "building", "ready", "failed", "deleting"] = Field(
        description="of the last build (queued: waiting for a worker to start it); a failed "
        "or running rebuild leaves the last good build in use"
    )
    error: str | None = Field(description="why the last build failed")
    build_id: str | None
    worker_id: str | None = Field(description="where it was built; null: on every worker")
    built: Built | None = Field(
        description="what the last good build made; how it was made (environment, steps, "
        "commands) only for admin keys"
    )
    created_at: datetime
    updated_at: datetime
    pool: Pool = Field(description="creates of exactly this shape are served from the pool")

    @classmethod
    def from_row(cls, row: Any, admin: bool = False) -> Template:
        pool = Pool(
            size=row["pool_size"], vcpus=row["pool_vcpus"], memory_mib=row["pool_memory_mib"],
            disk_mib=row["pool_disk_mib"], ready=row["pool_ready"],
            starting=row["pool_starting"],
        )  # fmt: skip
        record = row["record"]
        built = None
        if record:
            shown = {k: record[k] for k in Built.model_fields if k in record}
            if not admin:
                shown.update(BUILT_HIDDEN)
            built = Built.model_validate(shown)
        return cls(
            id=row["id"], state=row["state"], error=row["error"], build_id=row["build_id"],
            worker_id=row["worker_id"], built=built, created_at=row["created_at"],
            updated_at=row["updated_at"], pool=pool,
        )  # fmt: skip


TEMPLATE_ID = r"^[a-z0-9][a-z0-9._-]{0,63}$"
# How a template was made is the admins' business (its env may hold build-time values).
BUILT_HIDDEN: dict[str, Any] = {"source": "", "env": {}, "entrypoint": [], "cmd": [],
                                "start": None, "ready": None, "steps": []}  # fmt: skip


class CheckpointRef(Strict):
    sandbox_id: str = Field(max_length=64)
    checkpoint_id: str = Field(max_length=64)


class BuildRequest(Strict):
    """A spec or a Dockerfile to build, or a checkpoint of one of your sandboxes to make the
    template of."""

    spec: str = Field(default="", max_length=1 << 20, description="the space.toml text")
    dockerfile: str = Field(
        default="", max_length=1 << 20, description="instead of a spec: a Dockerfile's text "
        "(docs/templates.md says what each instruction becomes; its context's .dockerignore "
        "is kept)",
    )  # fmt: skip
    build_args: dict[str, str] = Field(
        default_factory=dict, max_length=256,
        description="with a dockerfile: values of its ARGs (docker build --build-arg)",
    )  # fmt: skip
    insecure: bool = Field(
        False, description="with a dockerfile: its FROM registry speaks plain HTTP (local hosts "
        "only)",
    )  # fmt: skip
    context: str = Field(
        "", max_length=MAX_CONTEXT_B64, description="base64 of a tar (optionally "
        "compressed) holding the files the spec's copy steps name, relative to the spec's "
        "directory (or the Dockerfile's build context)",
    )  # fmt: skip
    environ: dict[str, str] = Field(
        default_factory=dict,
        description="values of the environment variables the spec names for registry "
        "credentials (used for this build only, never stored)",
    )
    checkpoint: CheckpointRef | None = Field(
        None,
        description="instead of a spec: make the template of this checkpoint (its disk, and "
        "its memory with the processes running as the base snapshot of its shape); sandboxes "
        "of it have the checkpoint's vCPUs and memory",
    )

    @field_validator("environ")
    @classmethod
    def env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)

    @field_validator("build_args")
    @classmethod
    def arg_values(cls, args: dict[str, str]) -> dict[str, str]:
        if long := [k for k, v in args.items() if len(k) > 256 or len(v) > MAX_VALUE_BYTES]:
            raise ValueError(f"build_args {long[0][:64]!r}: names of at most 256 characters, "
                             f"values of at most {MAX_VALUE_BYTES}")  # fmt: skip
        return args

    @model_validator(mode="after")
    def one_source(self) -> BuildRequest:
        if self.spec and self.dockerfile:
            raise ValueError("give a spec or a dockerfile, not both")
        if (self.build_args or self.insecure) and not self.dockerfile:
            raise ValueError("build_args and insecure go with a dockerfile")
        check_build_source(self.spec or self.dockerfile, self.checkpoint, self.context,
                           self.environ)  # fmt: skip
        return self


class TemplateList(BaseModel):
    items: list[Template]


class NetworkUpdate(Strict):
    network: NetworkPolicy


class SecretPut(Strict):
    value: str = Field(min_length=1, max_length=65536)


class SecretInfo(BaseModel):
    name: str
    created_at: datetime
    updated_at: datetime


class SecretList(BaseModel):
    items: list[SecretInfo]


class AuditList(BaseModel):
    items: list[dict[str, Any]] = Field(
        description="the gateway's decisions for this sandbox, oldest first: seq, time (seconds "
        "since the epoch), kind (dns, tcp, tls, http, https, policy), decision (allow/deny), "
        "reason, host, port, address"
    )


class VolumeCreate(Strict):
    name: str = Field("", max_length=128)
    size_mib: int = Field(1024, ge=16, le=1 << 20)


class Volume(FromRow):
    id: str
    name: str
    size_mib: int
    state: Literal["available", "deleting", "deleted"]
    created_at: datetime


class VolumeList(BaseModel):
    items: list[Volume]


class SandboxList(BaseModel):
    items: list[Sandbox]
    next_cursor: str | None


class TimeoutUpdate(Strict):
    timeout_s: int = Field(ge=1, le=7 * 24 * 3600)


class ExecRequest(Strict):
    cmd: str | None = Field(None, min_length=1, max_length=131072)
    argv: list[Annotated[str, Field(max_length=131072)]] | None = Field(
        None, min_length=1, max_length=4096
    )
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, pattern=r"^/", max_length=4096)
    user: str | None = Field(None, min_length=1, max_length=64)
    timeout: float | None = Field(None, gt=0, le=86400)
    stdin: str | None = Field(None, description="base64", max_length=64 << 20)
    pty: bool = False
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)
    background: bool = Field(
        False, description="the process outlives this request: leaving its stream leaves it running"
    )
    tag: str | None = Field(
        None, max_length=64, description="names the running process (implies background)"
    )
    keep_stdin: bool = Field(False, description="stdin stays open after `stdin` was written")

    @field_validator("env")
    @classmethod
    def env_names(cls, env: dict[str, str]) -> dict[str, str]:
        return _check_env(env)

    @field_validator("tag")
    @classmethod
    def valid_tag(cls, tag: str | None) -> str | None:
        return None if tag is None else check_tag(tag)

    @model_validator(mode="after")
    def one_command(self) -> ExecRequest:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell command) or 'argv' (a list)")
        if any("\0" in a for a in self.argv or [self.cmd or ""]):
            raise ValueError("the command contains a NUL byte")
        return self


class Event(BaseModel):
    id: int
    at: datetime
    type: str
    from_state: str | None
    to_state: str | None
    reason: str | None


class EventList(BaseModel):
    items: list[Event]


class FileEntry(BaseModel):
    name: str
    path: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    target: str | None = None


class FileList(BaseModel):
    entries: list[FileEntry]


class WriteResult(BaseModel):
    size: int


LINK_MAX_S = 7 * 24 * 3600


class NewLink(Strict):
    port: int = Field(ge=1, le=65535)
    expires_in_s: int = Field(3600, ge=1, le=LINK_MAX_S)


class Link(BaseModel):
    url: str  # the port's preview host, with the token a browser trades for a cookie there
    port: int
    expires_at: datetime


class AuditRecord(BaseModel):
    """One call that changed something, or tried to (`outcome`: ok, refused or failed)."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime | None
    tenant_id: str | None
    key_id: str | None
    admin: bool
    method: str
    action: str = Field(
        description='the route it took, e.g. "POST /v1/sandboxes/{sandbox_id}/pause"'
    )
    path: str
    params: dict[str, str]
    created: str | None = Field(description="the id of what the call made, if it made one")
    status: int
    outcome: Literal["ok", "refused", "failed"]
    request_id: str | None
    remote: str | None


class AuditPage(BaseModel):
    items: list[AuditRecord]
    next: int | None = Field(description="pass as `after` for the next page; null: no more")


WebhookEvent = Literal[EVENT_TYPES]  # type: ignore[valid-type]


class NewWebhook(Strict):
    url: str = Field(min_length=1, max_length=2048, description="http:// or https://")
    events: list[WebhookEvent] = Field(
        default_factory=lambda: list(EVENT_TYPES), min_length=1, max_length=len(EVENT_TYPES),
        description="the event types it is sent (default: all)",
    )  # fmt: skip
    description: str = Field("", max_length=200)


class WebhookInfo(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    url: str
    events: list[str]
    description: str
    created_at: datetime


class CreatedWebhook(WebhookInfo):
    secret: str = Field(description="signs every delivery (Space-Signature): shown this once")


class WebhookList(BaseModel):
    items: list[WebhookInfo]


class WebhookAttempt(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    at: datetime
    status: int | None = Field(description="the endpoint's answer; null: none came")
    error: str | None
    ms: float


class WebhookDelivery(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    event_id: int
    type: str
    payload: dict[str, Any]
    state: Literal["pending", "delivered", "failed"]
    attempts: list[WebhookAttempt]
    created_at: datetime
    next_at: datetime


class WebhookDeliveryList(BaseModel):
    items: list[WebhookDelivery]


class Problem(BaseModel):
    type: str = "about:blank"
    title: str
    status: int
    detail: str
    state: str | None = None
    errors: list[dict[str, Any]] | None = None


class UsageFigures(BaseModel):
    """What was given and used in a span of time. Given: vCPUs and guest RAM times the seconds
    in each state. Used: the host's CPU time on its VMMs, storage over time, and bytes."""

    running_seconds: float = 0.0
    paused_seconds: float = 0.0
    suspended_seconds: float = 0.0
    vcpu_seconds_running: float = 0.0
    vcpu_seconds_paused: float = 0.0
    memory_gib_seconds_running: float = 0.0
    memory_gib_seconds_paused: float = 0.0
    cpu_seconds: float = Field(0.0, description="CPU time the host spent on the VMMs")
    disk_gib_hours: float = Field(0.0, description="root disks, as allocated on the pool")
    snapshot_gib_hours: float = Field(0.0, description="snapshots of suspended sandboxes")
    checkpoint_gib_hours: float = 0.0
    volume_gib_hours: float = Field(0.0, description="volumes, at the size they were made")
    net_rx_bytes: int = Field(0, description="received by the sandboxes' NICs")
    net_tx_bytes: int = Field(0, description="sent by the sandboxes' NICs (let out or not)")
    egress_bytes: int = Field(0, description="sent on to origins by the gateways")
    ingress_bytes: int = Field(0, description="received from origins by the gateways")


class UsagePoint(UsageFigures):
    at: datetime = Field(description="the start of its step")


class UsageSeries(BaseModel):
    key: str | None = Field(
        description="the tenant, sandbox, template or label value it is of (null: the total, "
        "or what has no such label)"
    )
    points: list[UsagePoint]
    total: UsageFigures


class UsageAnswer(BaseModel):
    since: datetime
    until: datetime
    step_s: int
    by: str
    series: list[UsageSeries]
    total: UsageFigures


class HostUsage(BaseModel):
    host: str
    sent_bytes: int
    received_bytes: int


class HostUsagePage(BaseModel):
    items: list[HostUsage]

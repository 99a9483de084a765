"""The values the API answers with, as frozen dataclasses built from its JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


def _time(value: Any) -> datetime:
    """An RFC 3339 string (the API's timestamps) or seconds since the epoch (file times)."""
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    return datetime.fromisoformat(value)


def _optional_time(value: Any) -> datetime | None:
    return None if value is None else _time(value)


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as the API last described it."""

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
    env: dict[str, str]
    metadata: dict[str, str]
    worker_id: str | None
    created_at: datetime
    updated_at: datetime
    boot: str | None = None  # how it first came to run: "pool", "restore" or "cold"
    idle_timeout_s: int | None = None  # paused after this long unused; None: never
    volumes: tuple[dict[str, Any], ...] = ()  # {"volume", "path", "read_only"} each

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SandboxInfo:
        return cls(
            id=data["id"],
            state=data["state"],
            desired_state=data["desired_state"],
            reason=data.get("reason"),
            template=data["template"],
            vcpus=data["vcpus"],
            memory_mib=data["memory_mib"],
            disk_mib=data["disk_mib"],
            timeout_s=data["timeout_s"],
            timeout_action=data["timeout_action"],
            expires_at=_optional_time(data.get("expires_at")),
            env=dict(data.get("env") or {}),
            metadata=dict(data.get("metadata") or {}),
            worker_id=data.get("worker_id"),
            created_at=_time(data["created_at"]),
            updated_at=_time(data["updated_at"]),
            boot=data.get("boot"),
            idle_timeout_s=data.get("idle_timeout_s"),
            volumes=tuple(dict(v) for v in data.get("volumes") or ()),
        )


@dataclass(frozen=True)
class PoolInfo:
    """A template's warm pool: creates of exactly this shape are served from it."""

    size: int
    vcpus: int
    memory_mib: int
    disk_mib: int
    ready: int
    starting: int


@dataclass(frozen=True)
class TemplateInfo:
    id: str
    state: str  # of its last build: building, ready, failed (or deleting)
    error: str | None  # why the last build failed
    built: dict[str, Any] | None  # what the last good build made: digest, env, command, steps…
    created_at: datetime
    pool: PoolInfo

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TemplateInfo:
        p = data["pool"]
        pool = PoolInfo(int(p["size"]), int(p["vcpus"]), int(p["memory_mib"]),
                        int(p["disk_mib"]), int(p["ready"]), int(p["starting"]))  # fmt: skip
        return cls(id=data["id"], state=data["state"], error=data.get("error"),
                   built=data.get("built"), created_at=_time(data["created_at"]),
                   pool=pool)  # fmt: skip


@dataclass(frozen=True)
class VolumeInfo:
    """A disk of the tenant's own that outlives its sandboxes."""

    id: str
    name: str
    size_mib: int
    state: str
    created_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VolumeInfo:
        return cls(id=data["id"], name=data["name"], size_mib=int(data["size_mib"]),
                   state=data["state"], created_at=_time(data["created_at"]))  # fmt: skip


@dataclass(frozen=True)
class SecretInfo:
    """A secret of the tenant's, by name: its value is never answered."""

    name: str
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SecretInfo:
        return cls(name=data["name"], created_at=_time(data["created_at"]),
                   updated_at=_time(data["updated_at"]))  # fmt: skip


@dataclass(frozen=True)
class CheckpointInfo:
    """Memory and disk of a sandbox at one moment (its volumes left out), kept on its worker."""

    id: str
    sandbox_id: str
    name: str
    state: str  # creating, ready or deleting
    size_bytes: int
    paused_ms: float | None  # how long the sandbox was paused to take it
    created_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointInfo:
        paused = data.get("paused_ms")
        return cls(id=data["id"], sandbox_id=data["sandbox_id"], name=data["name"],
                   state=data["state"], size_bytes=int(data["size_bytes"]),
                   paused_ms=float(paused) if paused is not None else None,
                   created_at=_time(data["created_at"]))  # fmt: skip


@dataclass(frozen=True)
class ExecResult:
    """How a command ended, with its whole output when it was collected (`exec`, not
    `exec_stream`, whose output went to the caller as it came)."""

    exit_code: int | None  # None when a signal ended the process
    signal: int | None
    timed_out: bool
    stdout: bytes
    stderr: bytes
    duration_ms: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def text(self) -> str:
        """stdout as text (UTF-8; undecodable bytes replaced)."""
        return self.stdout.decode(errors="replace")

    @classmethod
    def from_exit_event(cls, event: Mapping[str, Any]) -> ExecResult:
        return cls(
            exit_code=event.get("exit_code"),
            signal=event.get("signal"),
            timed_out=bool(event.get("timed_out")),
            stdout=b"",
            stderr=b"",
            duration_ms=float(event.get("duration_ms") or 0.0),
        )


@dataclass(frozen=True)
class ProcessInfo:
    """A process started in a sandbox (`sandbox.processes`): running, or a background one that
    ended (then `exit_code` or `signal` says how)."""

    pid: int
    tag: str | None
    command: str | list[str]  # a shell command, or the argv
    cwd: str | None
    pty: bool
    background: bool
    started_at: datetime
    running: bool
    exit_code: int | None
    signal: int | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessInfo:
        return cls(
            pid=data["pid"],
            tag=data.get("tag"),
            command=data["cmd"] if data.get("cmd") is not None else list(data.get("argv") or []),
            cwd=data.get("cwd"),
            pty=bool(data.get("pty")),
            background=bool(data.get("background")),
            started_at=_time(data["started_at"]),
            running=bool(data["running"]),
            exit_code=data.get("exit_code"),
            signal=data.get("signal"),
        )


@dataclass(frozen=True)
class FileEvent:
    """A change a file watch saw: `create` (also a move's new name), `write`, `remove`,
    `rename` (a move's old name), `chmod`, or `overflow` (events were lost; no path)."""

    type: str
    path: str | None
    is_dir: bool

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileEvent:
        return cls(type=data["type"], path=data.get("path"), is_dir=bool(data.get("is_dir")))


@dataclass(frozen=True)
class FileEntry:
    """A file, directory or link inside a sandbox."""

    name: str
    path: str
    type: str  # "file", "directory", "symlink" or "other"
    size: int
    mode: int  # permission bits, e.g. 0o644
    uid: int
    gid: int
    mtime: datetime
    target: str | None = None  # where a symlink points

    @property
    def is_dir(self) -> bool:
        return self.type == "directory"

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileEntry:
        return cls(
            name=data["name"],
            path=data["path"],
            type=data["type"],
            size=data["size"],
            mode=data["mode"],
            uid=data["uid"],
            gid=data["gid"],
            mtime=_time(data["mtime"]),
            target=data.get("target"),
        )


@dataclass(frozen=True)
class Event:
    """One step in a sandbox's life (created, a state change, an error)."""

    id: int | str
    at: datetime
    type: str
    from_state: str | None
    to_state: str | None
    reason: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Event:
        return cls(
            id=data["id"],
            at=_time(data["at"]),
            type=data["type"],
            from_state=data.get("from_state"),
            to_state=data.get("to_state"),
            reason=data.get("reason"),
        )


@dataclass(frozen=True)
class PreviewLink:
    """A link that opens a sandbox's port at its preview host in a browser, without a key,
    until `expires_at` (or until the key that made it is revoked)."""

    url: str
    port: int
    expires_at: datetime

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreviewLink:
        return cls(url=data["url"], port=data["port"], expires_at=_time(data["expires_at"]))


@dataclass(frozen=True)
class AuditRecord:
    """One call that changed something through the control plane, or tried to: who (tenant,
    key), what (`action`: the route; `created`: what it made), when, from where, how it ended."""

    id: int
    at: datetime
    tenant_id: str | None
    key_id: str | None
    admin: bool
    action: str
    params: dict[str, str]
    created: str | None
    status: int
    outcome: str  # ok, refused or failed
    request_id: str | None
    remote: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AuditRecord:
        return cls(
            id=int(data["id"]),
            at=_time(data["at"]),
            tenant_id=data.get("tenant_id"),
            key_id=data.get("key_id"),
            admin=bool(data.get("admin")),
            action=data["action"],
            params=dict(data.get("params") or {}),
            created=data.get("created"),
            status=int(data["status"]),
            outcome=data["outcome"],
            request_id=data.get("request_id"),
            remote=data.get("remote"),
        )


def _figures(data: Mapping[str, Any]) -> dict[str, float]:
    return {k: v for k, v in data.items() if k != "at" and isinstance(v, int | float)}


@dataclass(frozen=True)
class UsageSeries:
    """One group's usage (`key`: its tenant, sandbox, template or label value; None: the
    whole), a point per step with something in it: (start of the step, figures)."""

    key: str | None
    points: list[tuple[datetime, dict[str, float]]]
    total: dict[str, float]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UsageSeries:
        points = [(_time(p["at"]), _figures(p)) for p in data["points"]]
        return cls(key=data.get("key"), points=points, total=_figures(data["total"]))


@dataclass(frozen=True)
class Usage:
    """What sandboxes and volumes were given and used from `since` to `until` (figures such
    as `vcpu_seconds_running`, `cpu_seconds`, `egress_bytes`: docs/api.md lists them)."""

    since: datetime
    until: datetime
    step_s: int
    by: str
    series: list[UsageSeries]
    total: dict[str, float]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Usage:
        return cls(since=_time(data["since"]), until=_time(data["until"]),
                   step_s=int(data["step_s"]), by=data["by"],
                   series=[UsageSeries.from_json(x) for x in data["series"]],
                   total=_figures(data["total"]))  # fmt: skip


@dataclass(frozen=True)
class HostUsage:
    """Bytes the gateways sent on to a host, and received from it."""

    host: str
    sent_bytes: int
    received_bytes: int

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> HostUsage:
        return cls(data["host"], int(data["sent_bytes"]), int(data["received_bytes"]))


@dataclass(frozen=True)
class AuditEvent:
    """One decision of the sandbox's gateway on its egress (`kind`: dns, tcp, tls, http, https,
    policy; `decision`: allow or deny)."""

    seq: int
    time: datetime
    kind: str
    decision: str
    reason: str
    host: str | None
    port: int | None
    address: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AuditEvent:
        return cls(
            seq=data["seq"],
            time=_time(data["time"]),
            kind=data["kind"],
            decision=data["decision"],
            reason=data.get("reason", ""),
            host=data.get("host"),
            port=data.get("port"),
            address=data.get("address"),
        )

"""What the worker asks of a guest for itself, and what it gets back, typed.

Platform duties (flush, volumes, the root file system's size, the gateway's CA) are built-in
calls of the agent, done with system calls in the guest: never a program of the guest's, which
the tenant may have replaced. Answers are checked here (those of listings and file watches
too), since the agent may be hostile.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from space.guest import protocol as p
from space.worker.agent_channels import AgentError, AgentProtocolError, field


@dataclass(frozen=True)
class GuestVolume:
    """A volume to mount in the guest: the virtio disk whose serial is `serial`, at `target`."""

    serial: str
    target: str
    read_only: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"serial": self.serial, "target": self.target, "read_only": self.read_only}


@dataclass(frozen=True)
class MountedVolume:
    serial: str
    target: str
    device: str  # the guest's block device, e.g. /dev/vdb
    read_only: bool


@dataclass(frozen=True)
class UnmountResult:
    unmounted: tuple[str, ...]
    failed: Mapping[str, AgentError]  # target -> why it is (maybe still) mounted

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True)
class RootFsGrowth:
    disk_bytes: int  # the root disk as the guest sees it
    block_size: int
    fs_bytes_before: int  # the file system's size (statvfs) before and after
    fs_bytes: int


@dataclass(frozen=True)
class RootFsSealed:
    trimmed_bytes: int | None  # discarded free space; None if the disk could not trim
    read_only: bool  # remounted read-only (False: something still had a file open to write)


@dataclass(frozen=True)
class CAInstall:
    ca_path: str  # the CA alone (/etc/space/ca.pem)
    bundle_path: str  # the system's CAs and ours (/etc/space/ca-bundle.pem)
    bundle_size: int
    system_bundle: bool  # the guest had a system bundle, and it went in first


@dataclass(frozen=True)
class DirListing:
    entries: list[dict[str, Any]]
    truncated: bool  # there were more than the limit (or than fit one reply)


def mounted_volumes(body: dict[str, Any]) -> list[MountedVolume]:
    out = []
    for item in field(body, "mounted", list):
        if not isinstance(item, dict):
            raise AgentProtocolError("protocol", "the agent's 'mounted' holds a non-object")
        out.append(
            MountedVolume(
                serial=field(item, "serial", str),
                target=field(item, "target", str),
                device=field(item, "device", str),
                read_only=field(item, "read_only", bool),
            )
        )
    return out


def unmount_result(body: dict[str, Any]) -> UnmountResult:
    unmounted = field(body, "unmounted", list)
    failed = field(body, "failed", dict)
    if not all(isinstance(t, str) for t in unmounted):
        raise AgentProtocolError("protocol", "the agent's 'unmounted' holds a non-string")
    errors = {}
    for target, why in failed.items():
        if not isinstance(why, dict):
            raise AgentProtocolError("protocol", "the agent's 'failed' holds a non-object")
        errors[str(target)] = AgentError(
            str(why.get("code", "internal"))[:64], str(why.get("message", ""))[:4096]
        )
    return UnmountResult(tuple(unmounted), errors)


def root_fs_growth(body: dict[str, Any]) -> RootFsGrowth:
    return RootFsGrowth(
        disk_bytes=field(body, "disk_bytes", int),
        block_size=field(body, "block_size", int),
        fs_bytes_before=field(body, "fs_bytes_before", int),
        fs_bytes=field(body, "fs_bytes", int),
    )


def root_fs_sealed(body: dict[str, Any]) -> RootFsSealed:
    trimmed = body.get("trimmed_bytes")
    return RootFsSealed(
        trimmed_bytes=None if trimmed is None else field(body, "trimmed_bytes", int),
        read_only=field(body, "read_only", bool),
    )


def root_fs_frozen(body: dict[str, Any]) -> int | None:
    return None if body.get("trimmed_bytes") is None else field(body, "trimmed_bytes", int)


def root_fs_thawed(body: dict[str, Any]) -> bool:
    return field(body, "thawed", bool)


def processes_ended(body: dict[str, Any]) -> bool:
    return field(body, "ended", bool)


def ca_install(body: dict[str, Any]) -> CAInstall:
    return CAInstall(
        ca_path=field(body, "ca", str),
        bundle_path=field(body, "bundle", str),
        bundle_size=field(body, "bundle_size", int),
        system_bundle=field(body, "system_bundle", bool),
    )


def dir_listing(body: dict[str, Any], limit: int) -> DirListing:
    entries = field(body, "entries", list)
    if len(entries) > limit or not all(isinstance(e, dict) for e in entries):
        raise AgentProtocolError("protocol", f"the agent listed more than {limit} entries")
    return DirListing(entries, bool(body.get("truncated")))


WATCH_KINDS = frozenset({"create", "write", "remove", "rename", "chmod", "overflow"})


def watch_events(payload: bytes) -> list[dict[str, Any]]:
    """A watch's EVENT frame as events {type, path, is_dir}, each checked (`path` is absent
    from a queue overflow)."""
    try:
        body = p.decode_json(payload)
    except p.ProtocolError as e:
        raise AgentProtocolError("protocol", f"a watch event: {e}") from None
    events = []
    for event in field(body, "events", list):
        if not isinstance(event, dict) or event.get("type") not in WATCH_KINDS:
            raise AgentProtocolError("protocol", "the agent told a watch event of no known type")
        path = event.get("path")
        if path is not None and not (isinstance(path, str) and path.startswith("/")):
            raise AgentProtocolError("protocol", "the agent told a watch event without a path")
        events.append({"type": event["type"], "path": path, "is_dir": event.get("is_dir") is True})
    return events

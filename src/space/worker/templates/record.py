"""A built template as stored on disk: `<root>/templates/<name>/<digest>/template.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_FILE = "template.json"
ROOTFS_FILE = "rootfs.ext4"
SNAPSHOT_DIR = "snapshot"


def shape_error(record: dict[str, Any], vcpus: int, memory_mib: int) -> str | None:
    """Why a sandbox of this shape cannot be made of the template whose template.json is
    `record`, if it cannot: one made from a checkpoint has the checkpoint's shape."""
    fixed = (record.get("vcpus"), record.get("memory_mib"))
    if fixed[0] is None or fixed == (vcpus, memory_mib):
        return None
    return (
        f"template {record['name']} was made from a checkpoint of a sandbox with {fixed[0]} "
        f"vCPUs and {fixed[1]} MiB: its sandboxes have that shape, not {vcpus} vCPUs and "
        f"{memory_mib} MiB"
    )


def agent_user(user: str | None) -> str | int | None:
    """An image's user ("name", "uid", "uid:gid", "name:group") as the agent takes it: a name
    or a uid (the group is not used)."""
    if user is None:
        return None
    name = user.split(":", 1)[0]
    return int(name) if name.isdigit() else name


@dataclass(frozen=True)
class TemplateRecord:
    """What the worker needs to run sandboxes of a template.

    `env`, `workdir` and `user` are the defaults for processes in its sandboxes (from the image
    config, changed by the steps); `entrypoint` + `cmd` is the image's own command; `start` is
    the spec's start command (run once the sandbox is up) and `ready` a command that exits 0
    once the started service is ready.

    A template made from a checkpoint also keeps the checkpoint's snapshot (`snapshot`): its
    base snapshot is made from that, processes and all, so its sandboxes have the checkpoint's
    shape (`vcpus`, `memory_mib`).
    """

    name: str
    digest: str
    path: Path  # the template directory
    source: str
    source_digest: str
    size_bytes: int
    env: dict[str, str]
    workdir: str | None = None
    user: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    start: str | None = None
    ready: str | None = None
    steps: list[str] = field(default_factory=list)
    built_at: str = ""
    build_seconds: float = 0.0
    snapshot: str | None = None
    vcpus: int | None = None
    memory_mib: int | None = None

    @property
    def rootfs(self) -> Path:
        return self.path / ROOTFS_FILE

    @property
    def snapshot_path(self) -> Path | None:
        return self.path / self.snapshot if self.snapshot else None

    def shape_error(self, vcpus: int, memory_mib: int) -> str | None:
        return shape_error(self.to_json(), vcpus, memory_mib)

    @property
    def command(self) -> list[str]:
        """The image's default command: entrypoint followed by cmd."""
        return [*self.entrypoint, *self.cmd]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "digest": self.digest,
            "source": self.source,
            "source_digest": self.source_digest,
            "rootfs": ROOTFS_FILE,
            "size_bytes": self.size_bytes,
            "env": dict(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "start": self.start,
            "ready": self.ready,
            "steps": list(self.steps),
            "built_at": self.built_at,
            "build_seconds": self.build_seconds,
            "snapshot": self.snapshot,
            "vcpus": self.vcpus,
            "memory_mib": self.memory_mib,
        }

    @classmethod
    def load(cls, path: Path) -> TemplateRecord:
        data = json.loads((path / RECORD_FILE).read_text())
        snapshot = data.get("snapshot")
        if snapshot is not None and (not isinstance(snapshot, str) or "/" in snapshot
                                     or snapshot in ("", ".", "..")):  # fmt: skip
            raise ValueError(f"{path}: its snapshot {snapshot!r} is not a directory inside it")
        return cls(
            name=str(data["name"]),
            digest=str(data["digest"]),
            path=path,
            source=str(data["source"]),
            source_digest=str(data["source_digest"]),
            size_bytes=int(data["size_bytes"]),
            env={str(k): str(v) for k, v in data["env"].items()},
            workdir=data.get("workdir"),
            user=data.get("user"),
            entrypoint=list(data.get("entrypoint") or []),
            cmd=list(data.get("cmd") or []),
            start=data.get("start"),
            ready=data.get("ready"),
            steps=list(data.get("steps") or []),
            built_at=str(data.get("built_at", "")),
            build_seconds=float(data.get("build_seconds", 0.0)),
            snapshot=data.get("snapshot"),
            vcpus=data.get("vcpus"),
            memory_mib=data.get("memory_mib"),
        )

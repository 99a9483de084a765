"""What a worker trusts of a snapshot or template made on another host: its own files only
(never a path outside its directory), its empty slots, and this worker's guest kernel."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from space.worker.artifacts.trust import foreign_snapshot_problem
from space.worker.templates.record import TemplateRecord
from space.worker.vmm.base import Drive, SnapshotInfo, VMConfig, VMMError

KERNEL, INITRD = Path("/var/cache/space/kernel/vmlinux"), Path("/var/cache/space/kernel/initrd")


def worker() -> Any:
    """This worker's guest kernel, as its `base` images name it."""
    return SimpleNamespace(kernel=KERNEL, initrd=INITRD)


def snapshot(tmp: Path, **config: Any) -> SnapshotInfo:
    base = VMConfig(vm_id="sb-1", kernel=KERNEL, initrd=INITRD, rootfs=tmp / "disk")
    return SnapshotInfo(tmp, "qemu", base.with_changes(**config), {"disk": "disk"})


def test_a_snapshot_of_this_workers_kernel_with_empty_slots_only_may_run(tmp_path: Path) -> None:
    slots = (Drive(Path("/elsewhere/empty-slot.img"), "empty0", placeholder=True),)
    assert foreign_snapshot_problem(worker(), snapshot(tmp_path, drives=slots)) is None


@pytest.mark.parametrize(
    "config",
    [
        {"kernel": Path("/etc/shadow")},
        {"initrd": Path("/root/.ssh/id_ed25519")},
        {"memory_file": Path("/var/lib/space/pool/workers/w/vms/sb-2/memory")},
        {"drives": (Drive(Path("/var/lib/space/pool/workers/w/volumes/vol-1.img"), "vol-1"),)},
    ],
)
def test_a_snapshot_that_points_at_this_hosts_files_is_refused(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    assert foreign_snapshot_problem(worker(), snapshot(tmp_path, **config)) is not None


@pytest.mark.parametrize("name", ["../../workers/w/vms/sb-2/disk", "/etc/shadow", "..", ""])
def test_a_snapshot_naming_a_file_outside_its_directory_does_not_load(
    tmp_path: Path, name: str
) -> None:
    snap = snapshot(tmp_path)
    snap.save()
    manifest = json.loads((tmp_path / "snapshot.json").read_text())
    manifest["files"]["disk"] = name
    (tmp_path / "snapshot.json").write_text(json.dumps(manifest))
    with pytest.raises(VMMError, match="outside"):
        SnapshotInfo.load(tmp_path)


@pytest.mark.parametrize("name", ["../../other/template", "/etc", "."])
def test_a_template_whose_snapshot_is_outside_it_does_not_load(tmp_path: Path, name: str) -> None:
    record = {"name": "t", "digest": "0" * 16, "source": "s", "source_digest": "d",
              "size_bytes": 1, "env": {}, "snapshot": name}  # fmt: skip
    (tmp_path / "template.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="not a directory inside it"):
        TemplateRecord.load(tmp_path)

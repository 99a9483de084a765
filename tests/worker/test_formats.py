"""What a worker writes to disk or to the registry carries its format: the record of a later
release is refused with the reason, one from before formats were written is read as format 1,
and this release's own round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from space.worker import formats
from space.worker.artifacts import bundle
from space.worker.sandboxes.records import SANDBOX_FILE, SandboxSpec, SandboxVM
from space.worker.templates import oci
from space.worker.templates.errors import ImageError
from space.worker.vmm.base import SNAPSHOT_MANIFEST, SnapshotInfo, VMConfig, VMMError


def _rewrite(path: Path, **changes: object) -> None:
    record = json.loads(path.read_text())
    record.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del record[key]
    path.write_text(json.dumps(record))


def test_a_sandbox_record_of_a_later_release_is_refused(tmp_path: Path) -> None:
    SandboxVM("sb1", SandboxSpec("base", 1, 256), None, "restore", 1.0).save(tmp_path)
    assert json.loads((tmp_path / SANDBOX_FILE).read_text())["format"] == formats.FORMATS["sandbox"]
    assert SandboxVM.load("sb1", tmp_path, None).spec.memory_mib == 256
    _rewrite(tmp_path / SANDBOX_FILE, format=None)  # before formats were written
    assert SandboxVM.load("sb1", tmp_path, None).spec.template == "base"
    _rewrite(tmp_path / SANDBOX_FILE, format=formats.FORMATS["sandbox"] + 1)
    with pytest.raises(formats.FormatError, match="newer than release"):
        SandboxVM.load("sb1", tmp_path, None)


def test_a_snapshot_of_a_later_release_is_refused_with_the_reason(tmp_path: Path) -> None:
    config = VMConfig(vm_id="vm1", kernel=tmp_path / "k", rootfs=tmp_path / "r")
    SnapshotInfo(tmp_path, "qemu", config, {"disk": "disk.img"}).save()
    assert SnapshotInfo.load(tmp_path).config == config
    _rewrite(tmp_path / SNAPSHOT_MANIFEST, format="two")
    with pytest.raises(VMMError, match="is not a format"):
        SnapshotInfo.load(tmp_path)
    _rewrite(tmp_path / SNAPSHOT_MANIFEST, format=formats.FORMATS["snapshot"] + 1)
    with pytest.raises(VMMError, match=f"format {formats.FORMATS['snapshot'] + 1}"):
        SnapshotInfo.load(tmp_path)


def test_a_bundle_of_a_later_release_is_refused() -> None:
    blob = bundle.config("template", [], {})
    empty = oci.Manifest(oci.Descriptor(bundle.CONFIG_TYPE, oci.sha256_digest(blob), len(blob)), [])
    assert bundle.layout(blob, empty, "template").kind == "template"
    later = json.dumps({**json.loads(blob), "format": formats.FORMATS["bundle"] + 1}).encode()
    with pytest.raises(ImageError, match="newer than release"):
        bundle.layout(later, empty, "template")

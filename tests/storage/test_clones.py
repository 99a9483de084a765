"""Sandbox disks are reflinks of their template: 100 of a 1 GiB template cost almost nothing on
disk, by btrfs's own accounting, and a write in one is seen by no other."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.worker.storage import reflink
from space.worker.storage.pool import Pool, ensure_pool
from space.worker.storage.reflink import clone_file

GIB = 1 << 30


@pytest.fixture
def pool_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the pool needs root (it loop-mounts a btrfs image)")
    pool: Pool = ensure_pool()
    assert pool.reflinks, "the test pool must be btrfs (or XFS with reflinks)"
    d = pool.root / "test-clones"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def btrfs_du(path: Path) -> dict[str, int]:
    """`btrfs filesystem du -s` of path: total, exclusive and shared bytes."""
    subprocess.run(["btrfs", "filesystem", "sync", str(path)], check=True)
    out = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", str(path)],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    total, exclusive, shared = (int(x) for x in out.splitlines()[1].split()[:3])
    return {"total": total, "exclusive": exclusive, "shared": shared}


def digest(path: Path, offset: int, length: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read(length)).hexdigest()


def test_100_clones_of_a_1gib_template_cost_under_a_tenth_more(pool_dir: Path) -> None:
    template = pool_dir / "template.img"
    with open(template, "wb") as f:  # real data, not holes: every extent is allocated
        for _ in range(GIB >> 20):
            f.write(os.urandom(1 << 20))
    disks = pool_dir / "disks"
    disks.mkdir()
    for i in range(100):
        assert clone_file(template, disks / f"sb{i}.img") is True  # a reflink, not a copy

    usage = btrfs_du(pool_dir)
    # Every byte of the 101 files is in one set of extents: the template's.
    assert usage["total"] == 101 * GIB
    assert usage["shared"] + usage["exclusive"] < 1.1 * GIB, json.dumps(usage)

    # A write in one sandbox's disk lands in that disk only.
    before = digest(template, 512 << 20, 1 << 20)
    with open(disks / "sb7.img", "r+b") as f:
        f.seek(512 << 20)
        f.write(b"\xff" * (1 << 20))
    assert digest(disks / "sb7.img", 512 << 20, 1 << 20) != before
    for other in (template, disks / "sb0.img", disks / "sb8.img", disks / "sb99.img"):
        assert digest(other, 512 << 20, 1 << 20) == before
    written = btrfs_du(disks / "sb7.img")
    assert (1 << 20) <= written["exclusive"] <= (2 << 20), written


def test_a_file_from_another_file_system_is_copied_with_no_warning_about_the_pool(
    pool_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An image entering the pool from a cache on another file system is copied (a reflink
    cannot cross file systems); the pool clones well, and the log does not say otherwise."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "cache", str(tmp_path)], check=True)
    try:
        source, data = tmp_path / "image.img", os.urandom(1 << 20)
        source.write_bytes(data)
        with caplog.at_level("INFO", logger=reflink.__name__):
            assert clone_file(source, pool_dir / "image.img") is False  # copied
            assert clone_file(pool_dir / "image.img", pool_dir / "clone.img") is True
    finally:
        subprocess.run(["umount", str(tmp_path)], check=True)
    assert (pool_dir / "image.img").read_bytes() == (pool_dir / "clone.img").read_bytes() == data
    (record,) = caplog.records
    assert record.levelname == "INFO" and "cannot cross file systems" in record.message

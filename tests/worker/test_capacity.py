"""A worker's own admission: live VMs count as measured, others whole; vCPUs by the
overcommit ratio; the guest-memory mode never overcommits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from space.worker import ksm
from space.worker.sandboxes.capacity import OVERHEAD_FLOOR_MIB, Capacity, Claim
from space.worker.sandboxes.errors import NoRoom


def test_live_vms_count_as_measured_and_others_whole(tmp_path: Path) -> None:
    cap = Capacity(tmp_path, vcpus=None, memory_mib=2048, reserve_mib=512)
    held = [Claim(1, 1024, measured_mib=90), Claim(1, 1024, measured_mib=110)]
    assert cap.total(held).memory_mib == 200
    cap.reserve("a", Claim(1, 1024), held)  # 200 + 1024 + overhead fits in 1536
    with pytest.raises(NoRoom, match="MiB"):
        cap.reserve("b", Claim(1, 512), held)  # the first reservation counts whole
    cap.release("a")
    # A suspended or crashed one (not measured) holds its whole resume.
    assert cap.total([Claim(1, 1024)]).memory_mib == 1024 + OVERHEAD_FLOOR_MIB


def test_guest_mode_counts_guest_ram_whatever_was_measured(tmp_path: Path) -> None:
    cap = Capacity(tmp_path, vcpus=None, memory_mib=2048, reserve_mib=512, admit_memory="guest")
    held = [Claim(1, 1024, measured_mib=90)]
    assert cap.total(held).memory_mib == 1024 + OVERHEAD_FLOOR_MIB
    with pytest.raises(NoRoom):
        cap.reserve("a", Claim(1, 1024), held)


def test_vcpus_come_from_the_overcommit_ratio(tmp_path: Path) -> None:
    cap = Capacity(tmp_path, vcpus=None, memory_mib=1 << 20, reserve_mib=0, vcpu_overcommit=4)
    assert cap.vcpus == 4 * (os.cpu_count() or 1)
    with pytest.raises(NoRoom, match="vCPUs"):
        cap.reserve("a", Claim(cap.vcpus + 1, 128), [])


def test_measurements_follow_the_vms_running_now(tmp_path: Path) -> None:
    cap = Capacity(tmp_path, vcpus=None, memory_mib=2048, reserve_mib=0)
    cap.measure([("me", os.getpid(), 1)])
    assert cap.pss_mib["me"] > 0
    cap.measure([])
    assert cap.pss_mib == {}


def test_ksm_is_set_as_the_worker_is_told(tmp_path: Path) -> None:
    for name, value in (("run", "0"), ("pages_to_scan", "100"), ("sleep_millisecs", "20"),
                        ("use_zero_pages", "0")):  # fmt: skip
        (tmp_path / name).write_text(value)
    assert ksm.configure("on", 2000, 10, root=tmp_path) is None
    names = ("run", "pages_to_scan", "sleep_millisecs", "use_zero_pages")
    assert [(tmp_path / n).read_text() for n in names] == ["1", "2000", "10", "1"]
    assert ksm.configure("off", 2000, 10, root=tmp_path) is None
    assert (tmp_path / "run").read_text() == "0"
    (tmp_path / "run").write_text("1")
    assert ksm.configure("host", 1, 1, root=tmp_path) is None  # left alone
    assert (tmp_path / "run").read_text() == "1"
    assert "CONFIG_KSM" in (ksm.configure("on", 1, 1, root=tmp_path / "none") or "")

"""Which acceleration a worker takes, from the probe's cache: a restart (of this release or the
one before it, with another guest kernel) must not spend the probe's whole timeout again on a
host whose KVM already failed a guest; KVM is taken only where a probe of this guest proved it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from space.worker.vmm import accel

HOST = os.uname().release


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPACE_CACHE_DIR", str(tmp_path))

    def no_probe(*_: object) -> tuple[bool, str]:
        raise AssertionError("probed")

    monkeypatch.setattr(accel, "probe_kvm", no_probe)
    return tmp_path / "accel.json"


def write(cache: Path, key: str, answer: str, why: str = "a KVM guest did not reach init") -> None:
    cache.write_text(json.dumps({"key": key, "accel": answer, "why": why}))


def test_the_answer_for_this_kernel_holds(cache: Path) -> None:
    write(cache, f"{HOST}/k1", "kvm", "a KVM guest reached init in 1.2s")
    assert accel.cached("k1") == ("kvm", "a KVM guest reached init in 1.2s")
    assert accel.choose_accel(Path("v"), Path("i"), "k1") == "kvm"


def test_tcg_of_another_guest_kernel_on_this_host_holds_without_a_probe(cache: Path) -> None:
    write(cache, f"{HOST}/old-kernel", "tcg")
    assert accel.choose_accel(Path("v"), Path("i"), "new-kernel") == "tcg"
    # Left as it was: the release that wrote it finds its own answer when it comes back.
    assert json.loads(cache.read_text())["key"] == f"{HOST}/old-kernel"


def test_what_is_probed_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # KVM proven for another guest kernel, an answer of another host kernel, a device that
    # has appeared since: none holds.
    write(cache, f"{HOST}/old-kernel", "kvm")
    assert accel.cached("new-kernel") is None
    write(cache, "another-host-kernel/k1", "tcg")
    assert accel.cached("k1") is None
    write(cache, f"{HOST}/old-kernel", "tcg", accel.NO_DEVICE)
    monkeypatch.setattr(os, "access", lambda *_: True)
    assert accel.cached("new-kernel") is None
    monkeypatch.setattr(os, "access", lambda *_: False)
    assert accel.cached("new-kernel") == ("tcg", accel.NO_DEVICE)
    cache.write_text("not json")
    assert accel.cached("k1") is None
    probed: list[str] = []

    def probe(*_: object) -> tuple[bool, str]:
        probed.append("yes")
        return False, "a KVM guest did not reach init within 20s"

    monkeypatch.setattr(accel, "probe_kvm", probe)
    assert accel.choose_accel(Path("v"), Path("i"), "k1") == "tcg" and probed == ["yes"]
    assert json.loads(cache.read_text())["key"] == f"{HOST}/k1"

"""Installing the platform's CA in a guest whose root (the tenant) has laid traps: the agent's
code run on the host against a directory standing in for /etc (tests/vm runs it in a VM)."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from space.guest import trust
from space.guest.common import OpError

PEM = b"-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
SYSTEM = b"-----BEGIN CERTIFICATE-----\nMIIBsystem\n-----END CERTIFICATE-----"


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    (tmp_path / "etc" / "ssl" / "certs").mkdir(parents=True)
    return tmp_path / "etc"


def install(etc: Path) -> dict[str, object]:
    return trust.install(PEM, str(etc), str(etc / "ssl/certs/ca-certificates.crt"))


def test_bundle_is_the_system_one_then_ours_root_owned_0644(etc: Path) -> None:
    (etc / "ssl/certs/ca-certificates.crt").write_bytes(SYSTEM)
    (etc / "space").mkdir(mode=0o777)
    os.chown(etc / "space", 1000, 1000)  # made by someone else: taken back
    result = install(etc)
    assert (etc / "space/ca.pem").read_bytes() == PEM
    assert (etc / "space/ca-bundle.pem").read_bytes() == SYSTEM + b"\n" + PEM
    assert result["system_bundle"] is True and result["bundle_size"] == len(SYSTEM) + 1 + len(PEM)
    for path, mode in ((etc / "space", 0o755), (etc / "space/ca.pem", 0o644),
                       (etc / "space/ca-bundle.pem", 0o644)):  # fmt: skip
        st = path.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (mode, 0, 0), path
    assert sorted(os.listdir(etc / "space")) == ["ca-bundle.pem", "ca.pem"]  # no temporaries


def test_without_a_system_bundle_the_bundle_is_our_ca(etc: Path) -> None:
    assert install(etc)["system_bundle"] is False
    assert (etc / "space/ca-bundle.pem").read_bytes() == PEM


def test_a_symlinked_ca_directory_is_refused(etc: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (etc / "space").symlink_to(elsewhere)
    with pytest.raises(OpError, match="symbolic link") as e:
        install(etc)
    assert e.value.code == "invalid"
    assert os.listdir(elsewhere) == []


def test_links_in_the_ca_directory_are_replaced_never_written_through(
    etc: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    (etc / "space").mkdir()
    (etc / "space/ca.pem").symlink_to(victim)
    (etc / "space/ca-bundle.pem").symlink_to(victim)
    install(etc)
    assert victim.read_bytes() == b"untouched"
    assert not (etc / "space/ca.pem").is_symlink()
    assert (etc / "space/ca.pem").read_bytes() == PEM


def test_a_huge_system_bundle_is_refused_not_read(etc: Path) -> None:
    with open(etc / "ssl/certs/ca-certificates.crt", "wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte
    with pytest.raises(OpError, match="larger than") as e:
        install(etc)
    assert e.value.code == "invalid"
    assert not (etc / "space/ca-bundle.pem").exists()


def test_a_fifo_or_a_device_as_system_bundle_is_refused_without_blocking(etc: Path) -> None:
    bundle = etc / "ssl/certs/ca-certificates.crt"
    os.mkfifo(bundle)  # nobody writes it: a plain open would wait for ever
    outcome: list[BaseException] = []
    worker = threading.Thread(target=lambda: _capture(outcome, lambda: install(etc)))
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "install blocked on a FIFO"
    assert isinstance(outcome[0], OpError) and "not a regular file" in outcome[0].message
    bundle.unlink()
    bundle.symlink_to("/dev/zero")  # a link is followed, but only to a regular file
    with pytest.raises(OpError, match="not a regular file"):
        install(etc)


def test_a_ca_path_taken_by_a_directory_fails_cleanly(etc: Path) -> None:
    (etc / "space/ca.pem").mkdir(parents=True)
    with pytest.raises(OpError, match=r"ca\.pem"):
        install(etc)
    assert [n for n in os.listdir(etc / "space") if n.startswith(".")] == []


def _capture(into: list[BaseException], fn: Callable[[], object]) -> None:
    try:
        fn()
    except BaseException as e:
        into.append(e)

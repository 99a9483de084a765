"""Backups that restore, on a platform of its own: back up, make and delete sandboxes, restore,
and the written rule holds (docs/upgrading.md): a sandbox the restored database does not know
is kept with its files and reported as a stray until an operator discards it; a row whose VM
is gone turns to error with the reason; secrets stay sealed in the backup and open after the
restore; the controller leads again with an epoch the workers take."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from space.db import backup as backups

from ..network.world import BEARER
from ..stack import Platform, launch, shut_down
from ..vm.conftest import vmm_pids
from .helpers import create, fetch, run, wait_state

POOL = Path("/var/lib/space/pool/workers")


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    """Not the session's platform: a restore turns its whole database back."""
    p = launch(tmp_path_factory.mktemp("backup"), SPACE_GC_INTERVAL="2")
    try:
        yield p
    finally:
        shut_down(p)


def admin(p: Platform, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "space.cli.main", "admin", *args], env=p.env,
        capture_output=True, text=True, timeout=600, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what} not within {timeout} s"
        time.sleep(0.5)
    return found


def test_a_restore_keeps_what_the_backup_never_knew(own: Platform, tmp_path: Path) -> None:
    with own.client() as c:
        assert c.put("/v1/secrets/bearer", json={"value": BEARER}).status_code == 200
        before = create(c)
        wait_state(c, before["id"], "running", timeout=120)
        dump = tmp_path / "space.dump"
        made = admin(own, "backup", str(dump))
        assert made.returncode == 0, made.stderr
        assert dump.stat().st_mode & 0o077 == 0, "a backup is for root's eyes"
        # The dump is compressed: what it holds is what pg_restore writes out of it.
        sql = subprocess.run([str(backups.tools() / "pg_restore"), "-f", "-", str(dump)],
                             capture_output=True, check=True, timeout=120).stdout  # fmt: skip
        assert b"COPY public.secrets" in sql, "the secrets' table is in it"
        assert BEARER.encode() not in sql, "secrets stay sealed in a backup"

        after = create(c)  # made after the backup: the restored database never heard of it
        wait_state(c, after["id"], "running", timeout=120)
        assert run(c, after["id"], "echo kept > /root/work && sync")[2] == 0
        assert c.delete(f"/v1/sandboxes/{before['id']}").status_code in (200, 202, 204)
        wait_state(c, before["id"], "deleted", timeout=60)

        own.controller.stop()
        restored = admin(own, "restore", "--yes", str(dump))
        assert restored.returncode == 0, restored.stderr
        own.controller.start()

        # The row whose VM went after the backup: error, with the reason.
        wait_state(c, before["id"], "error", timeout=90, reason="gone")
        # The sandbox it never knew: kept on its worker and reported, through clean-ups.
        strays = until(lambda: _strays(own), 90, "the stray reported")
        assert strays == [{"id": after["id"], "worker_id": own.worker_id, "discarded": False}]
        # Two more clean-up passes (every 2 s) name it, and leave it be.
        named = f"{own.worker_id} holds sandboxes the database does not know"
        seen = (own.tmp / "controller.log").read_text().count(named)
        until(lambda: (own.tmp / "controller.log").read_text().count(named) >= seen + 2, 30,
              "two more clean-ups")  # fmt: skip
        assert vmm_pids(POOL / own.worker_id / "vms" / after["id"]), "the stray's VM runs on"
        # The restored database's secret still opens (the same secrets key): the gateway
        # swaps it in for the sandbox's placeholder.
        sb = create(
            c,
            network={"hosts": [{"pattern": "secret.test"}]},
            secrets=[{"secret": "bearer", "hosts": ["secret.test"], "env": "TOKEN"}],
        )
        assert sb["state"] == "running", sb
        placeholder = run(c, sb["id"], "echo $TOKEN")[0].decode().strip()
        got = fetch(c, sb["id"], "https://secret.test/auth", f"Authorization:Bearer {placeholder}")
        assert got == (0, "auth-ok"), got

        discarded = admin(own, "strays", "--discard", after["id"])
        assert discarded.returncode == 0, discarded.stderr
        until(lambda: not vmm_pids(POOL / own.worker_id / "vms" / after["id"]), 60,
              "the discarded stray deleted")  # fmt: skip
        until(lambda: _strays(own) == [], 60, "the discarded stray forgotten")


def _strays(p: Platform) -> list[dict[str, Any]]:
    out = admin(p, "strays", "--json")
    assert out.returncode == 0, out.stderr
    found: list[dict[str, Any]] = json.loads(out.stdout)
    return found

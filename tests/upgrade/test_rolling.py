"""A rolling upgrade from the previous release (CHANGELOG.md names its commit) to this one, and
back, on a platform of its own, with a client working throughout.

The platform starts as the previous release, schema included, and is given what a tenant
holds: a running sandbox with a volume, a paused one, a suspended one, one with a checkpoint,
and a warm pool. Then, one at a time, the schema, the API, the controller and the worker are
replaced by this release's (the worker adopts the VMs the old one left running); and the same
back, the schema staying (expand, then contract: the old release works on the new schema).
After each direction, every sandbox holds its files and its processes run on. The client saw
no error, only waits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from space.release import VERSION

from ..platform.helpers import counter_runs, create, out, start_counter
from ..stack import Platform, launch, shut_down
from .rollout import Traffic, check_out, migrate, previous_release, replace, summary

pytestmark = pytest.mark.vm

POOL_SIZE = 2
# The longest a client's round (create, a command, delete) may take while a service is
# replaced: a worker's restart, and the pool refilling behind it, under TCG.
BOUNDED_S = 90.0


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    version, commit = previous_release()
    return version, check_out(commit, tmp_path_factory.mktemp("previous"))


@pytest.fixture(scope="module")
def old(tmp_path_factory: pytest.TempPathFactory, previous: tuple[str, Path]) -> Iterator[Platform]:
    # The deployment's own bound for a worker that stopped answering (the other platforms of
    # the tests lose one after 3 s, to be quick): a worker's restart must stay within it.
    p = launch(tmp_path_factory.mktemp("upgrade"), release=previous[1], SPACE_WORKER_LOST_AFTER="8")
    try:
        yield p
    finally:
        shut_down(p)


@dataclass
class Holdings:
    """What a tenant has on the platform while it is upgraded."""

    running: str
    counter: int
    volume: str
    paused: str
    paused_counter: int
    suspended: str
    suspended_counter: int
    checkpointed: str
    checkpoint: str


def change(c: httpx.Client, sandbox_id: str, verb: str, state: str) -> None:
    r = c.post(f"/v1/sandboxes/{sandbox_id}/{verb}")
    assert r.status_code == 200 and r.json()["state"] == state, (verb, r.text)


def hold(p: Platform) -> Holdings:
    with p.client() as c:
        volume = c.post("/v1/volumes", json={"size_mib": 64}).json()["id"]
        running = create(c, volumes=[{"volume": volume, "path": "/data"}])["id"]
        out(c, running, "echo running > /root/note; echo volume > /data/note; sync")
        counter = start_counter(c, running)
        paused = create(c)["id"]
        out(c, paused, "echo paused > /root/note")
        paused_counter = start_counter(c, paused)
        change(c, paused, "pause", "paused")
        suspended = create(c)["id"]
        out(c, suspended, "echo suspended > /root/note")
        suspended_counter = start_counter(c, suspended)
        change(c, suspended, "suspend", "suspended")
        checkpointed = create(c)["id"]
        out(c, checkpointed, "echo before > /root/note")
        ck = c.post(f"/v1/sandboxes/{checkpointed}/checkpoints", json={"name": "before"})
        assert ck.status_code == 201, ck.text
        out(c, checkpointed, "echo after > /root/note")
    return Holdings(running, counter, volume, paused, paused_counter, suspended,
                    suspended_counter, checkpointed, ck.json()["id"])  # fmt: skip


def check(p: Platform, h: Holdings, release: str) -> None:
    """Everything is as it was left, and each sandbox goes back to the state it was in, so the
    next release meets the same (now written by `release`)."""
    with p.client() as c:
        assert out(c, h.running, "cat /root/note /data/note") == "running\nvolume\n", release
        assert counter_runs(c, h.running, h.counter), f"{release}: its process stopped"
        for sandbox_id, pid, note, verb, state in (
            (h.paused, h.paused_counter, "paused", "pause", "paused"),
            (h.suspended, h.suspended_counter, "suspended", "suspend", "suspended"),
        ):
            assert c.get(f"/v1/sandboxes/{sandbox_id}").json()["state"] == state, release
            change(c, sandbox_id, "resume", "running")
            assert out(c, sandbox_id, "cat /root/note") == f"{note}\n", release
            assert counter_runs(c, sandbox_id, pid), f"{release}: the {note} one's process"
            change(c, sandbox_id, verb, state)
        r = c.post(f"/v1/sandboxes/{h.checkpointed}/checkpoints/{h.checkpoint}/rollback")
        assert r.status_code == 200, (release, r.text)
        assert out(c, h.checkpointed, "cat /root/note") == "before\n", release
        out(c, h.checkpointed, "echo after > /root/note")


def versions(p: Platform) -> tuple[str, list[str]]:
    with p.client(p.admin_key) as admin:
        api = httpx.get(f"{p.api_url}/healthz", timeout=10).json().get("version", "")
        workers = [w.get("version", "") for w in admin.get("/v1/workers").json()["items"]]
    return api, workers


def test_a_rolling_upgrade_and_its_rollback_lose_nothing(
    old: Platform, previous: tuple[str, Path]
) -> None:
    version, code = previous
    with old.client(old.admin_key) as admin:
        r = admin.put("/v1/templates/base/pool", json={"size": POOL_SIZE})
        assert r.status_code == 200, r.text
    h = hold(old)
    (worker_id,) = old.workers
    worker = old.workers[worker_id]

    before = versions(old)
    assert before[0] != VERSION and VERSION not in before[1], before  # the old code runs
    with Traffic(old.api_url, old.key_a) as traffic:
        traffic.wait_rounds("before", 3)
        migrate(old, traffic)
        replace(old, traffic, "api", old.api, None)
        replace(old, traffic, "controller", old.controller, None)
        replace(old, traffic, "worker", worker, None)
        traffic.step = "upgraded"
        assert versions(old) == (VERSION, [VERSION])
        check(old, h, VERSION)
        traffic.wait_rounds("upgraded", 2)

        replace(old, traffic, "worker back", worker, code)
        replace(old, traffic, "controller back", old.controller, code)
        replace(old, traffic, "api back", old.api, code)
        traffic.step = "rolled back"
        assert versions(old) == before
        check(old, h, version)
        traffic.wait_rounds("rolled back", 2)

    print(summary(traffic.rounds))
    assert traffic.errors() == [], "\n".join(traffic.errors())
    slowest = max(r.create_s + r.exec_s + r.delete_s for r in traffic.rounds)
    assert slowest < BOUNDED_S, summary(traffic.rounds)

"""Warm pools on the real platform: claims are atomic, personalised and never leak between
tenants; broken members are replaced; the response and the metrics say which path was taken.

The pool here has a shape no other test asks for (192 MiB), so the rest of the suite keeps
taking the restore path; the module turns the pool off again when it is done.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..stack import Platform
from ..vm.conftest import vmm_pids
from .helpers import create, run

SHAPE = {"vcpus": 1, "memory_mib": 192, "disk_mib": 1024}
SIZE = 3
POOL_DIR = Path("/var/lib/space/pool/workers")


def pool_state(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/v1/templates/base")
    assert r.status_code == 200, r.text
    return dict(r.json()["pool"])


def wait_ready(c: httpx.Client, ready: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    state: dict[str, Any] = {}
    while time.monotonic() < deadline:
        state = pool_state(c)
        if state["ready"] == ready and state["starting"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the pool did not settle at {ready} ready in {timeout}s: {state}")


def listed(c: httpx.Client) -> set[str]:
    return {sb["id"] for sb in c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]}


def members(platform: Platform) -> set[str]:
    """Ids of the VMs the workers hold that no tenant of ours owns: the pool's members."""
    ours: set[str] = set()
    for key in (platform.key_a, platform.key_b, platform.admin_key):
        with platform.client(key) as c:
            ours |= listed(c)
    held = {p.name for d in POOL_DIR.glob("*/vms") if d.parent.name in platform.workers
            for p in d.iterdir()}  # fmt: skip
    return held - ours


@pytest.fixture(scope="module")
def admin(platform: Platform) -> Iterator[httpx.Client]:
    with platform.client(platform.admin_key) as c:
        r = c.put("/v1/templates/base/pool", json={"size": SIZE, **SHAPE})
        assert r.status_code == 200, r.text
        try:
            wait_ready(c, SIZE)
            yield c
        finally:
            c.put("/v1/templates/base/pool", json={"size": 0, **SHAPE})
            wait_ready(c, 0)


def test_a_claim_is_a_running_personalised_sandbox(admin: httpx.Client, platform: Platform) -> None:
    before = members(platform)
    with platform.client() as c:
        sb = create(c, **SHAPE, env={"GREETING": "hello from a"}, metadata={"who": "a"})
        assert sb["boot"] == "pool" and sb["state"] == "running", sb
        assert sb["id"] in before  # it was one of the members
        assert sb["env"] == {"GREETING": "hello from a"} and sb["metadata"] == {"who": "a"}
        out, _, code = run(c, sb["id"], "echo $GREETING; hostname")
        assert code == 0 and out.decode().split() == ["hello", "from", "a", sb["id"]]
        # Its history starts at the claim: the pool's own events are not the tenant's.
        events = c.get(f"/v1/sandboxes/{sb['id']}/events").json()["items"]
        assert events[0]["type"] == "created" and events[0]["reason"] == "from the warm pool"
        # Nothing ever ran in it before: the only processes are the agent, the kernel's
        # threads and this very command.
        ps = "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
        out, _, _ = run(c, sb["id"], ps)
        commands = [line for line in out.decode().splitlines() if line.strip()]
        assert all("space" in line or "/proc/[0-9]" in line or line.startswith(("sh ", "tr "))
                   for line in commands), commands  # fmt: skip
        # The pool refills behind the claim, with a new member.
        wait_ready(admin, SIZE)
        assert sb["id"] not in members(platform)
        c.delete(f"/v1/sandboxes/{sb['id']}")


def test_creates_the_pool_cannot_serve_fall_back_to_a_restore(
    admin: httpx.Client, platform: Platform
) -> None:
    with platform.client() as c:
        other_shape = create(c, vcpus=1, memory_mib=256, disk_mib=1024)
        chosen_id = create(c, id=f"mine-{os.getpid()}", **SHAPE)  # an id of the client's own
        for sb in (other_shape, chosen_id):
            assert sb["state"] == "running" and sb["boot"] in ("restore", "cold"), sb
            c.delete(f"/v1/sandboxes/{sb['id']}")
    assert pool_state(admin)["ready"] + pool_state(admin)["starting"] == SIZE


def test_concurrent_creates_never_share_a_member(admin: httpx.Client, platform: Platform) -> None:
    wait_ready(admin, SIZE)

    def one(i: int) -> tuple[dict[str, Any], bytes]:
        with platform.client(platform.key_a if i % 2 else platform.key_b) as c:
            sb = create(c, **SHAPE, env={"TAG": f"t{i}"})
            out, _, _ = run(c, sb["id"], "echo $TAG")
            return sb, out

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    ids = [sb["id"] for sb, _ in results]
    assert len(set(ids)) == 8
    assert [out.decode().strip() for _, out in results] == [f"t{i}" for i in range(8)]
    boots = [sb["boot"] for sb, _ in results]
    assert 1 <= boots.count("pool") <= SIZE, boots
    assert set(boots) <= {"pool", "restore", "cold"}
    for i, (sb, _) in enumerate(results):
        with platform.client(platform.key_a if i % 2 else platform.key_b) as c:
            c.delete(f"/v1/sandboxes/{sb['id']}")


def settled_members(platform: Platform, timeout: float = 30) -> set[str]:
    """The members once sandboxes deleted just before have left their workers' disks: a
    delete answers before the worker has removed the VM's directory."""
    deadline = time.monotonic() + timeout
    while len(held := members(platform)) != SIZE and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(held) == SIZE, f"workers hold {platform.rows(held)} beyond our tenants' sandboxes"
    return held


def test_members_are_nobodys_until_claimed(admin: httpx.Client, platform: Platform) -> None:
    wait_ready(admin, SIZE)
    unclaimed = settled_members(platform)
    for key in (platform.key_a, platform.key_b, platform.admin_key):
        with platform.client(key) as c:
            assert not listed(c) & unclaimed
            for member in unclaimed:
                assert c.get(f"/v1/sandboxes/{member}").status_code == 404
                r = c.post(f"/v1/sandboxes/{member}/exec", json={"cmd": "true"})
                assert r.status_code == 404, r.text
                assert c.delete(f"/v1/sandboxes/{member}").status_code == 404
    # A sandbox A used and deleted never goes back to the pool: B's claim is another VM.
    with platform.client(platform.key_a) as a, platform.client(platform.key_b) as b:
        sa = create(a, **SHAPE)
        run(a, sa["id"], "echo secret-of-a > /root/mark")
        a.delete(f"/v1/sandboxes/{sa['id']}")
        wait_ready(admin, SIZE)
        sb = create(b, **SHAPE)
        assert sb["id"] != sa["id"]
        _, _, code = run(b, sb["id"], "test -e /root/mark")
        assert code == 1
        b.delete(f"/v1/sandboxes/{sb['id']}")


def test_a_broken_member_is_replaced(admin: httpx.Client, platform: Platform) -> None:
    wait_ready(admin, SIZE)
    victim = sorted(settled_members(platform))[0]
    pids = {pid for wid in platform.workers for pid in vmm_pids(POOL_DIR / wid / "vms" / victim)}
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while victim in members(platform) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim not in members(platform)
    wait_ready(admin, SIZE)


def test_pool_settings_are_checked(admin: httpx.Client, platform: Platform) -> None:
    with platform.client() as c:  # not an admin key
        r = c.put("/v1/templates/base/pool", json={"size": 1})
        assert r.status_code == 403 and "admin" in r.json()["detail"]
        assert c.get("/v1/templates").status_code == 200
    r = admin.put("/v1/templates/nope/pool", json={"size": 1})
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    for bad in ({"size": -1}, {"size": 1, "memory_mib": 1}, {"size": 1, "extra": 1}, {}):
        r = admin.put("/v1/templates/base/pool", json=bad)
        assert r.status_code == 422, (bad, r.text)
    assert pool_state(admin)["size"] == SIZE


def test_metrics_show_hits_misses_and_refills(admin: httpx.Client, platform: Platform) -> None:
    auth = {"Authorization": f"Bearer {platform.metrics_token}"}
    for url in (f"{platform.api_url}/metrics", platform.controller_metrics):
        for wrong in (
            {},
            {"Authorization": "Bearer nope"},
            {"Authorization": f"Bearer {platform.key_a}"},
        ):
            assert httpx.get(url, headers=wrong).status_code == 401, (url, wrong)
    text = httpx.get(f"{platform.api_url}/metrics", headers=auth).text
    hits = re.search(r'space_pool_claims_total\{result="hit",template="base"\} (\d+)', text)
    misses = re.search(r'space_pool_claims_total\{result="miss",template="base"\} (\d+)', text)
    assert hits and int(hits[1]) >= 1 and misses and int(misses[1]) >= 1, text
    pool_creates = r'space_sandbox_create_seconds_count\{boot="pool",template="base"\} [1-9]'
    assert re.search(pool_creates, text)
    assert f'space_pool_size{{template="base"}} {SIZE}.0' in text
    controller = httpx.get(platform.controller_metrics, headers=auth).text
    refills = re.search(r'space_pool_refill_seconds_count\{template="base"\} (\d+)', controller)
    assert refills and int(refills[1]) >= SIZE, controller
    assert re.search(r'space_pool_dropped_total\{template="base",why="broken"\} [1-9]', controller)

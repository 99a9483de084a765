"""Density on the real platform: admission counts what VMs really take, a full platform says so
at once, the host merges what clones share, and the idle policy pauses what nobody uses and
resumes it on its next use with its processes alive."""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

import space
from space.db.store import Store, connect

from ..stack import Platform
from .helpers import counter_runs, create, run, start_counter, wait_state

KSM = Path("/sys/kernel/mm/ksm")


def worker_info(platform: Platform) -> dict[str, Any]:
    with platform.client(platform.admin_key) as admin:
        r = admin.get("/v1/workers")
        assert r.status_code == 200, r.text
        (info,) = [w for w in r.json()["items"] if w["id"] == platform.worker_id]
        return dict(info)


def active_workers(platform: Platform) -> list[dict[str, Any]]:
    """Every active worker: a test that made a second one leaves it."""
    with platform.client(platform.admin_key) as admin:
        items = admin.get("/v1/workers").json()["items"]
    return [w for w in items if w["state"] == "active"]


def all_workers(platform: Platform) -> dict[str, int]:
    """The figures of every active worker added up."""
    keys = ("sandboxes", "memory_used_mib", "guest_memory_mib")
    return {k: sum(w[k] for w in active_workers(platform)) for k in keys}


def test_admission_counts_what_vms_really_take(platform: Platform) -> None:
    with platform.client() as c:
        # Big guests that touch little: by guest RAM they would hold 2 GiB and more.
        sbs = [create(c, memory_mib=1024) for _ in range(2)]
        try:
            # Counted whole until the worker measures them (every few seconds), then as
            # measured.
            deadline = time.monotonic() + 30
            info = all_workers(platform)
            while info["memory_used_mib"] >= info["guest_memory_mib"]:
                assert time.monotonic() < deadline, info
                time.sleep(0.5)
                info = all_workers(platform)
            assert info["memory_used_mib"] > 0 and info["sandboxes"] >= 2, info
        finally:
            for sb in sbs:
                c.delete(f"/v1/sandboxes/{sb['id']}")
    # Only admins see the hosts.
    with platform.client() as c:
        r = c.get("/v1/workers")
        assert r.status_code == 403 and "admin" in r.json()["detail"]


def test_a_full_platform_answers_at_once_with_its_reason(platform: Platform) -> None:
    # More memory than the worker admits (the test platform's worker admits 16 GiB with its
    # VMM's overhead): no worker can take it now, so it is refused rather than left pending.
    with platform.client() as c:
        before = {sb["id"] for sb in c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]}
        r = c.post("/v1/sandboxes", json={"memory_mib": 16384})
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        assert "no worker can take" in r.json()["detail"] and "MiB in use" in r.json()["detail"]
        # A client that would rather wait for room says how long; then it gets the same.
        t = time.monotonic()
        r = c.post("/v1/sandboxes", params={"room_wait_s": 2}, json={"memory_mib": 16384})
        assert r.status_code == 503 and time.monotonic() - t >= 1.5, r.text
        r = c.post("/v1/sandboxes", params={"room_wait_s": 301}, json={})
        assert r.status_code == 422 and "room_wait_s" in r.text, r.text
        after = {sb["id"] for sb in c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]}
        assert after == before  # nothing was left behind waiting


WAITING = sa.text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")


@contextmanager
def creates_held_at_insert(database_url: str, waiting: int) -> Iterator[None]:
    """Hold every tenant's row locked, as an insert of a sandbox does, until `waiting` queries
    wait for it (or 30 s passed); then let them all go at once. Creates held there have passed
    the API's admission, each seeing room that the others then take."""
    locked = threading.Event()

    async def hold() -> None:
        store = Store(connect(database_url, pool_size=2))
        try:
            async with store.engine.begin() as c, store.engine.connect() as look:
                await c.execute(sa.text("SELECT id FROM tenants FOR UPDATE"))
                locked.set()
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if (await look.execute(WAITING)).scalar_one() >= waiting:
                        break
                    await asyncio.sleep(0.05)
        finally:
            await store.close()

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        holder = ex.submit(asyncio.run, hold())
        assert locked.wait(10)
        yield
        holder.result(timeout=40)


def test_a_create_that_placement_cannot_fit_is_given_up_at_once(platform: Platform) -> None:
    """The API's admission and placement disagree when creates race for the last room: the
    ones placement cannot fit are given up within seconds (503 and why), never left hanging,
    and hold nothing afterwards."""
    workers = [w for w in active_workers(platform) if not w["problem"]]
    # Each worker fits one at a time (two would take more than 1.2 times the most any worker
    # admits), and one fits where there is room for it now. Admission counts what VMs were
    # measured to use, so a worker that measures its new VM before the others are given up
    # has room for one more: twice the workers and one more, and one is sure to find none.
    overhead = max(w["overhead_mib"] for w in workers)
    room = max(w["memory_mib"] - w["memory_used_mib"] for w in workers)
    size = min(16384, max(w["memory_mib"] for w in workers) * 3 // 5, room - overhead - 512)
    assert size >= 1024, workers
    body = {"memory_mib": size, "metadata": {"race": "room"}}
    creates = 2 * len(workers) + 1
    with platform.client() as c, concurrent.futures.ThreadPoolExecutor(creates) as ex:
        with creates_held_at_insert(platform.database_url, waiting=creates):
            answers = [ex.submit(timed, c, body) for _ in range(creates)]
        released = time.monotonic()
        replies = [a.result() for a in answers]
        made = [r.json()["id"] for r, _ in replies if r.status_code == 201]
        try:
            refused = [(r, done - released) for r, done in replies if r.status_code == 503]
            said = [(r.status_code, r.text) for r, _ in replies]
            assert 1 <= len(made) < creates and len(refused) == creates - len(made), said
            for r, took in refused:
                assert int(r.headers["Retry-After"]) >= 1
                assert "no worker can take this sandbox now: waiting for" in r.json()["detail"]
                # Given up after the API's grace (5 s), not the 300 s a create may wait.
                assert took < 15, took
            # What was given up goes (its delete was asked before the 503), and held nothing.
            deadline = time.monotonic() + 30
            while True:
                listed = c.get("/v1/sandboxes", params={"metadata.race": "room"}).json()["items"]
                left = {sb["id"]: sb["state"] for sb in listed if sb["id"] not in made}
                if list(left.values()) == ["deleted"] * len(refused):
                    break
                assert time.monotonic() < deadline, f"given-up creates: {left}"
                time.sleep(0.5)
        finally:
            for sid in made:
                c.delete(f"/v1/sandboxes/{sid}")


def timed(c: httpx.Client, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    reply = c.post("/v1/sandboxes", json=body)
    return reply, time.monotonic()


def test_the_worker_reports_what_ksm_merges(platform: Platform) -> None:
    # The deployment's default leaves ksmd off (the worker turned it off); what it would save
    # is measured by bench/density.py, and ksm.configure's writes by tests/worker.
    assert (KSM / "run").read_text().strip() == "0"
    text = httpx.get(
        platform.worker_metrics[platform.worker_id],
        headers={"Authorization": f"Bearer {platform.metrics_token}"},
    ).text
    assert re.search(r"space_worker_ksm_saved_bytes\{[^}]*\} \S+", text), text
    assert re.search(r"space_worker_memory_bytes\{[^}]*\} [1-9]", text), text


def test_idle_sandboxes_pause_and_resume_on_their_next_use(platform: Platform) -> None:
    with space.Space(platform.api_url, platform.key_a) as sdk:  # as a user of the SDK would
        made = space.Sandbox.create(client=sdk, idle_timeout_s=3)
        assert made.info.idle_timeout_s == 3
    with platform.client() as c:
        sb = c.get(f"/v1/sandboxes/{made.id}").json()
        pid = start_counter(c, sb["id"])
        # A stream held open is use: a command longer than the timeout is not cut off.
        out, _, code = run(c, sb["id"], "sleep 6; echo done")
        assert code == 0 and out == b"done\n"
        paused = wait_state(c, sb["id"], "paused", timeout=30)
        events = c.get(f"/v1/sandboxes/{sb['id']}/events").json()["items"]
        assert any("idle for" in (e["reason"] or "") for e in events), events
        assert paused["desired_state"] == "paused"
        # Its next use resumes it, with its processes as they were.
        out, _, code = run(c, sb["id"], "echo back")
        assert code == 0 and out == b"back\n"
        assert c.get(f"/v1/sandboxes/{sb['id']}").json()["state"] == "running"
        assert counter_runs(c, sb["id"], pid)
        # Paused by its owner, it stays paused: a call is refused, not a resume.
        assert c.post(f"/v1/sandboxes/{sb['id']}/pause").json()["state"] == "paused"
        r = c.post(f"/v1/sandboxes/{sb['id']}/exec", json={"cmd": "true"})
        assert r.status_code == 409, r.text
        assert c.get(f"/v1/sandboxes/{sb['id']}").json()["state"] == "paused"
        c.delete(f"/v1/sandboxes/{sb['id']}")
        # Without an idle timeout nothing pauses it.
        other = create(c, idle_timeout_s=0)
        assert other["idle_timeout_s"] is None
        time.sleep(5)
        assert c.get(f"/v1/sandboxes/{other['id']}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{other['id']}")


def test_idle_timeouts_are_checked(platform: Platform) -> None:
    with platform.client() as c:
        for bad in (-1, 7 * 24 * 3600 + 1, "soon"):
            r = c.post("/v1/sandboxes", json={"idle_timeout_s": bad})
            assert r.status_code == 422 and "idle_timeout_s" in r.text, r.text

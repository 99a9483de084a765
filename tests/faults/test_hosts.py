"""Faults of whole processes: a worker or the leader frozen, the gateway killed, the database
stopped. Each checks that nothing is lost and that states converge within a stated bound."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from space.db import embedded
from space.db import tables as t
from space.db.store import Store, connect

from ..platform.helpers import counter_runs, create, fetch, run, start_counter
from ..stack import Platform, Service
from .conftest import record, shown_active, until

pytestmark = pytest.mark.vm

LOST_S = 10.0  # a worker that stops answering is declared lost within this
BACK_S = 10.0  # and its sandboxes are back in their states within this once it answers


def _state(c: httpx.Client, sid: str) -> dict[str, object]:
    return dict(c.get(f"/v1/sandboxes/{sid}").json())


async def _rows(url: str, query: sa.Select[tuple[object, ...]]) -> list[dict[str, object]]:
    store = Store(connect(url, pool_size=1))
    try:
        async with store.engine.connect() as c:
            return [dict(r) for r in (await c.execute(query)).mappings()]
    finally:
        await store.close()


def rows(platform: Platform, query: sa.Select[tuple[object, ...]]) -> list[dict[str, object]]:
    import asyncio

    return asyncio.run(_rows(platform.database_url, query))


def test_a_frozen_worker_is_lost_in_time_and_its_sandboxes_come_back(
    platform: Platform, worker: Service
) -> None:
    assert worker.proc is not None
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
        run(c, sid, "echo kept > /root/kept")
        os.kill(worker.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            lost = until(lambda: "lost" in str(_state(c, sid).get("reason")), 30)
            record("worker frozen (SIGSTOP)", "its sandboxes show the loss", LOST_S, lost)
            assert _state(c, sid)["state"] == "error"
            # No worker can take a sandbox now: a create says so at once, it does not hang.
            started = time.monotonic()
            r = c.post("/v1/sandboxes", json={})
            answered = time.monotonic() - started
            assert r.status_code == 503 and "lost" in r.json()["detail"], r.text
            assert r.headers["retry-after"]
            record("create while the only worker is lost", "answered 503 with the reason",
                   1.0, answered)  # fmt: skip
            time.sleep(max(0.0, 20 - (time.monotonic() - frozen)))
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        back = until(lambda: _state(c, sid)["state"] == "running", 60)
        record("worker frozen 20 s, then continued", "its sandboxes back to running",
               BACK_S, back)  # fmt: skip
        assert counter_runs(c, sid, pid), "its processes ran on"
        assert run(c, sid, "cat /root/kept")[0] == b"kept\n"
        c.delete(f"/v1/sandboxes/{sid}")


def _gateway_pid(platform: Platform) -> int:
    return int(Path(f"/var/lib/space/gateway-{platform.worker_id}/gateway.pid").read_text())


def _worker_healthy(platform: Platform) -> bool:
    """The worker's own word (not the leader's last probe): no problem, its gateway up."""
    svc = platform.workers[platform.worker_id]
    port = svc.argv[svc.argv.index("--port") + 1]
    secret = platform.env["SPACE_WORKER_SECRET"]
    r = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {secret}"})
    return r.status_code == 200 and r.json()["healthy"] is True


def test_a_killed_gateway_is_restarted_with_every_policy(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c, network={"hosts": [{"pattern": "allowed.test"}]})["id"]
        assert fetch(c, sid, "http://allowed.test/")[0] == 0
        old = _gateway_pid(platform)
        os.killpg(old, signal.SIGKILL)
        killed = time.monotonic()
        until(lambda: _gateway_pid(platform) != old, 30)
        # The worker is healthy again once its new gateway holds every policy.
        until(lambda: _worker_healthy(platform), 30, step=0.05)
        record("gateway killed (kill -9)", "a new gateway with every policy reinstalled",
               5.0, time.monotonic() - killed)  # fmt: skip
        # The guest's next fetch gets out (its resolver may first wait out one query sent to
        # the dead gateway: 5 s by default).
        until(lambda: fetch(c, sid, "http://allowed.test/")[0] == 0, 30, step=0.2)
        record("gateway killed (kill -9)", "a guest's egress in force again", 15.0,
               time.monotonic() - killed)  # fmt: skip
        assert fetch(c, sid, "http://other.test/")[0] == 3, "still deny-by-default after it"
        assert _state(c, sid)["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")
    # While it was down the worker said so (and took no new VM); now it is healthy again.
    until(lambda: rows(platform, sa.select(t.workers.c.problem))[0]["problem"] is None, 10)


def test_a_database_outage_kills_no_worker(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
    pgdata = platform.tmp / "pg"
    embedded.stop(pgdata)
    time.sleep(10)
    embedded.start(pgdata)
    restarted = time.monotonic()
    with platform.client() as c:
        answers = until(lambda: _answers(c, sid), 60, step=0.2)
        record("PostgreSQL stopped for 10 s", "the API answers again", 5.0, answers)
        # Not a worker's death: the sandbox never left `running`, and it works.
        time.sleep(3)  # a grace period would have run out by now
        assert _state(c, sid)["state"] == "running"
        events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
        assert not [e for e in events if e["to_state"] == "error"], events
        assert counter_runs(c, sid, pid)
        done = time.monotonic() - restarted
        assert run(c, sid, "echo ok")[0] == b"ok\n"
        record("PostgreSQL stopped for 10 s", "no worker lost, sandboxes still running",
               15.0, done)  # fmt: skip
        workers = rows(platform, sa.select(t.workers.c.state))
        assert {w["state"] for w in workers} == {"active"}, workers
        c.delete(f"/v1/sandboxes/{sid}")


def _answers(c: httpx.Client, sid: str) -> bool:
    try:
        return c.get(f"/v1/sandboxes/{sid}").status_code == 200
    except httpx.TransportError:
        return False


def lease(platform: Platform) -> tuple[int, str]:
    """The leader's lease: its epoch and its holder (which names the holder's pid)."""
    (row,) = rows(platform, sa.select(t.leases.c.epoch, t.leases.c.holder))
    return int(str(row["epoch"])), str(row["holder"])


def leads(platform: Platform, svc: Service) -> bool:
    assert svc.proc is not None
    return f"-{svc.proc.pid}-" in lease(platform)[1]


def test_a_frozen_leader_is_replaced_and_cannot_act_after(platform: Platform) -> None:
    standby = Service("controller-b", ["-v", "controller"], platform.env,
                      platform.tmp / "controller-b.log")  # fmt: skip
    standby.start()
    leader = platform.controller
    assert leader.proc is not None
    try:
        until(lambda: "standing by" in standby.log.read_text(), 30)
        assert leads(platform, leader)
        before, _ = lease(platform)
        os.kill(leader.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            until(lambda: leads(platform, standby), 30, step=0.2)
            record("leader frozen (SIGSTOP)", "a standby leads, with the next epoch", 15.0,
                   time.monotonic() - frozen)  # fmt: skip
            assert lease(platform)[0] == before + 1
            with platform.client() as c:
                sid = create(c)["id"]  # served by the new leader
                assert _state(c, sid)["state"] == "running"
        finally:
            os.kill(leader.proc.pid, signal.SIGCONT)
        # Woken, the old leader finds its lease gone and stops acting; whatever it had in
        # flight carries the old epoch, which the worker and the database refuse.
        until(lambda: "leadership lost" in leader.log.read_text()
              or "taken over" in leader.log.read_text(), 30)  # fmt: skip
        assert leads(platform, standby)
        with platform.client() as c:
            assert c.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
            events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
            assert len([e for e in events if e["to_state"] == "starting"]) == 1, events
            c.delete(f"/v1/sandboxes/{sid}")
    finally:
        standby.stop()
    # The standby let go of its lease as it stopped: the platform's controller leads again.
    until(lambda: leads(platform, leader), 30, step=0.2)


def test_a_volume_whose_holder_was_deleted_while_its_worker_was_away_moves_on(
    platform: Platform, worker: Service
) -> None:
    """A is deleted while its worker is frozen; B then takes A's volume. The returning worker
    still runs A: B waits (starting, with the reason) while A is ended, then runs with the
    volume's data. Never two writers."""
    assert worker.proc is not None
    with platform.client() as c:
        r = c.post("/v1/volumes", json={"name": "moves-on", "size_mib": 64})
        assert r.status_code == 201, r.text
        vol = r.json()["id"]
        mount = {"volume": vol, "path": "/data", "read_only": False}
        a = create(c, volumes=[mount])["id"]
        run(c, a, "echo kept > /data/kept && sync")
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            until(lambda: "lost" in str(_state(c, a).get("reason")), 30)
            r = c.delete(f"/v1/sandboxes/{a}")
            assert r.status_code == 200, r.text
            until(lambda: _state(c, a)["state"] == "deleted", 30)
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        back = time.monotonic()
        shown_active(platform, platform.worker_id)
        r = c.post("/v1/sandboxes", json={"volumes": [mount]}, timeout=120)
        assert r.status_code in (200, 201, 202), r.text
        b = r.json()["id"]
        until(lambda: _state(c, b)["state"] in ("running", "error"), 60)
        record("a volume's old holder deleted while its worker was away",
               "the new sandbox runs with the volume", 30.0, time.monotonic() - back)  # fmt: skip
        assert _state(c, b)["state"] == "running", _state(c, b)
        assert run(c, b, "cat /data/kept")[0] == b"kept\n"
        c.delete(f"/v1/sandboxes/{b}")
        c.delete(f"/v1/volumes/{vol}")

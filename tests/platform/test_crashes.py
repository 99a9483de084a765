"""`kill -9` of any service loses nothing; workers come and go; sandboxes spread and clean up."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from space.db import embedded

from ..leaks import counts, resources
from ..stack import Platform, Service
from .helpers import counter_runs, create, run, start_counter, wait_state

pytestmark = pytest.mark.vm


def test_controller_killed_mid_create_then_it_completes(platform: Platform) -> None:
    with platform.client() as c:
        r = c.post("/v1/sandboxes", params={"wait": "false"}, json={})
        assert r.status_code == 202
        sid = r.json()["id"]
        platform.controller.kill9()
        time.sleep(0.5)
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] in ("pending", "starting", "running")
        platform.controller.start()
        wait_state(c, sid, "running", timeout=120)
        assert run(c, sid, "echo ok")[0] == b"ok\n"
        c.delete(f"/v1/sandboxes/{sid}")


def test_api_killed_mid_operation_loses_nothing(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
    result: dict[str, object] = {}

    def suspend() -> None:
        try:
            with platform.client() as c2:
                result["r"] = c2.post(f"/v1/sandboxes/{sid}/suspend")
        except httpx.TransportError as e:
            result["error"] = e

    t = threading.Thread(target=suspend)
    t.start()
    time.sleep(0.3)
    platform.api.kill9()
    t.join()
    platform.api.start()
    platform.wait_api()
    with platform.client() as c:
        # The intent was written before the API died: the controller finishes it.
        wait_state(c, sid, "suspended", timeout=60)
        assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_stopping_api_answers_the_connections_it_had_accepted(platform: Platform) -> None:
    """A rollout stops an API replica while clients connect to it: a connection accepted just
    before the stop, whose request arrives after it, is answered, not reset."""
    url = httpx.URL(platform.api_url)
    with socket.create_connection((url.host, url.port), timeout=10) as conn:
        time.sleep(0.2)  # accepted
        assert platform.api.proc is not None
        platform.api.proc.terminate()  # the stop a rollout makes
        try:
            time.sleep(0.3)  # the stop is under way
            conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        finally:
            platform.api.proc.wait(30)
            platform.api.start()
            platform.wait_api()
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_worker_killed_marks_sandboxes_then_readopts_them(platform: Platform) -> None:
    worker_id, worker = next(iter(platform.workers.items()))
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
        worker.kill9()
        t0 = time.monotonic()
        sb = wait_state(c, sid, "error", timeout=15, reason=f"worker {worker_id} lost")
        assert time.monotonic() - t0 < 10, "the loss must be noticed within seconds"
        assert sb["reason"]
        worker.start()
        wait_state(c, sid, "running", timeout=90)
        assert counter_runs(c, sid, pid), "the VM must survive its worker's death"
        c.delete(f"/v1/sandboxes/{sid}")


def test_suspended_sandbox_survives_a_restart_of_everything(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
        run(c, sid, "echo kept > /root/mark")
        assert c.post(f"/v1/sandboxes/{sid}/suspend").json()["state"] == "suspended"
    services = [platform.api, platform.controller, *platform.workers.values()]
    for svc in services:
        svc.kill9()
    pgdata = platform.tmp / "pg"
    embedded.stop(pgdata)
    embedded.start(pgdata)
    for svc in services:
        svc.start()
    platform.wait_api()
    with platform.client() as c:
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"
        assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        assert counter_runs(c, sid, pid)
        assert run(c, sid, "cat /root/mark")[0] == b"kept\n"
        c.delete(f"/v1/sandboxes/{sid}")


def test_two_workers_share_the_load(platform: Platform) -> None:
    second = f"t{secrets.token_hex(3)}"
    platform.add_worker(second)
    with platform.client() as c:
        deadline = time.monotonic() + 60
        placed = ""
        while time.monotonic() < deadline and placed != second:  # until it has registered
            sid = create(c)["id"]
            placed = c.get(f"/v1/sandboxes/{sid}").json()["worker_id"]
            c.delete(f"/v1/sandboxes/{sid}", params={"wait": "false"})
        with platform.client(platform.admin_key) as admin:
            assert placed == second, admin.get("/v1/workers").text
        # The least loaded worker takes each: the new one until it holds as much as the first
        # (which may hold what earlier tests left), then both in turn.
        ids: list[str] = []
        workers: set[str] = set()
        while len(workers) < 2 and len(ids) < 12:
            ids.append(create(c)["id"])
            workers.add(c.get(f"/v1/sandboxes/{ids[-1]}").json()["worker_id"])
        assert len(workers) == 2, workers
        for sid in ids:
            c.delete(f"/v1/sandboxes/{sid}")


def test_fifty_concurrent_creates_and_deletes_leak_nothing(platform: Platform) -> None:
    with platform.client() as c:  # warm the base snapshots first, so the count is steady
        c.delete(f"/v1/sandboxes/{create(c, memory_mib=128)['id']}")
    workers = list(platform.workers)
    before = resources(workers)
    # The count must see what it counts: a sandbox has a VMM, a namespace with its tap in it,
    # a host link and a run directory, each found where it lives.
    with platform.client() as c:
        probe = create(c, memory_mib=128)["id"]
        during = counts(workers)
        c.delete(f"/v1/sandboxes/{probe}")
    for kind in ("vmm", "netns", "taps", "host_links", "vm_dirs"):
        assert during[kind] >= 1, (kind, during)

    def one(_: int) -> str:
        with platform.client() as c:
            sb = create(c, memory_mib=128)
            assert sb["state"] == "running", sb
            assert run(c, sb["id"], "echo $((6*7))")[0] == b"42\n"
            gone = c.delete(f"/v1/sandboxes/{sb['id']}")
            assert gone.json()["state"] == "deleted", gone.text
            return str(sb["id"])

    with ThreadPoolExecutor(max_workers=50) as pool:
        ids = list(pool.map(one, range(50)))
    assert len(set(ids)) == 50
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and resources(workers) != before:
        time.sleep(0.5)
    assert resources(workers) == before


def test_a_standby_controller_takes_over_and_never_acts_twice(platform: Platform) -> None:
    standby = Service(
        "controller-2", ["-v", "controller"], platform.env, platform.tmp / "controller-2.log"
    )
    standby.start()
    try:
        deadline = time.monotonic() + 30  # (its start-up alone takes a while on a busy host)
        while time.monotonic() < deadline and not _elected(standby.log.read_text()):
            time.sleep(0.2)
        said = standby.log.read_text()
        assert "standing by" in said and "controller leads (epoch" not in said, said
        with platform.client() as c:
            sid = create(c)["id"]
            events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
            starts = [e for e in events if e["to_state"] == "starting"]
            assert len(starts) == 1, events  # one leader: one placement
            platform.controller.kill9()
            assert c.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
            c.delete(f"/v1/sandboxes/{sid}")
    finally:
        standby.stop()
        platform.controller.start()


def _elected(log: str) -> bool:
    """The replica has asked for the lease and knows whether it leads."""
    return "standing by" in log or "this controller leads" in log

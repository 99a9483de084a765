"""Many hosts on one machine: a platform in mutual TLS whose workers each run in a network
namespace of their own, reaching the control plane and the registry only over its link, with a
pool of their own (nothing on disk is shared between them), and whose templates, snapshots and
volumes go through a real registry (Debian's docker-registry). A template built on one host
runs on another once its builder is gone for good; the host that pulled it is preferred next;
deleting the template takes it off every host that holds it; a base snapshot made on one host
is pulled by the next. A sandbox suspended on a host lost for good resumes on another with its
files and processes, even if the registry was down for a while; a detached volume moves off a
host lost for good with its data; a drain moves what can leave and keeps new work away."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.db.store import Store, connect
from tests.registry import Registry, serve_registry

from ..stack import HOST_NS, Platform, control_address, launch, shut_down
from .helpers import counter_runs, create, run, start_counter, wait_state

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from serve_registry(tmp_path_factory.mktemp("hosts-registry"), address=control_address())


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> Iterator[Platform]:
    """Three hosts. Not the session's platform: launched and shut down before it."""
    p = launch(tmp_path_factory.mktemp("hosts"), tls=True, registry=registry.host)
    try:
        for _ in range(2):
            p.add_worker(f"h{secrets.token_hex(3)}")
        wait_for_workers(p, 3)
        yield p
    finally:
        shut_down(p)


def worker_rows(p: Platform) -> dict[str, dict[str, Any]]:
    async def read() -> dict[str, dict[str, Any]]:
        store = Store(connect(p.database_url, pool_size=1))
        try:
            return {w["id"]: dict(w) for w in await store.workers()}
        finally:
            await store.close()

    return asyncio.run(read())


def wait_for_workers(p: Platform, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sum(w["state"] == "active" for w in worker_rows(p).values()) < n:
        assert time.monotonic() < deadline, p.logs()
        time.sleep(0.5)


def test_each_host_reaches_the_control_plane_only_over_its_own_link(hosts: Platform) -> None:
    """A worker's network is its namespace's: the control plane's loopback, where the database
    and every other service of this machine listen, is not its loopback."""
    root = os.readlink("/proc/self/ns/net")  # this test runs where the control plane does
    seen = set()
    for worker_id, svc in hosts.workers.items():
        mine = os.readlink(f"/proc/{svc.pid}/ns/net")
        assert mine != root and mine not in seen
        seen.add(mine)
        api_port = hosts.api_url.rsplit(":", 1)[1]
        probe = ("import socket, sys\n"
                 "for host in ('127.0.0.1', sys.argv[1]):\n"
                 "    try:\n"
                 "        socket.create_connection((host, int(sys.argv[2])), 2).close()\n"
                 "        print(host, 'open')\n"
                 "    except OSError:\n"
                 "        print(host, 'closed')\n")  # fmt: skip
        out = subprocess.run(
            ["nsenter", f"--net=/run/netns/{HOST_NS}{worker_id}", sys.executable, "-c", probe,
             hosts.api_url.split("//")[1].rsplit(":", 1)[0], api_port],
            capture_output=True, text=True, check=True,
        ).stdout.split("\n")  # fmt: skip
        assert out[:2] == ["127.0.0.1 closed", f"{control_address()} open"], out


def build(admin: httpx.Client, name: str, spec: str) -> dict[str, Any]:
    r = admin.post(f"/v1/templates/{name}/builds", json={"spec": spec})
    assert r.status_code == 202, r.text
    with admin.stream("GET", f"/v1/templates/{name}/build/log") as log:
        text = "".join(log.iter_text())
    deadline = time.monotonic() + 60
    while (tpl := admin.get(f"/v1/templates/{name}").json())["state"] in ("queued", "building"):
        assert time.monotonic() < deadline, tpl
        time.sleep(0.2)
    assert tpl["state"] == "ready", (tpl, text)
    assert "pushed: " in text, text
    return dict(tpl)


def holds(p: Platform, worker_id: str, name: str) -> list[Path]:
    """The builds of template `name` on that host's disk."""
    return sorted((p.pool_of(worker_id) / "templates" / name).glob("*/template.json"))


def test_a_template_built_on_one_host_runs_on_another_once_its_builder_is_gone(
    hosts: Platform, registry: Registry
) -> None:
    mark = secrets.token_hex(6)  # new each run: no step cache may answer for it
    spec = ('[template]\nname = "far"\nfrom = "debian:bookworm"\n[[steps]]\n'
            f'run = "echo {mark} > /opt/mark"\n')  # fmt: skip
    with hosts.client(hosts.admin_key) as admin, hosts.client() as c:
        tpl = build(admin, "far", spec)
        artifact = tpl["built"]["artifact"]
        assert artifact.startswith(f"{registry.host}/space/templates/far@sha256:"), tpl
        (builder,) = [w for w in hosts.workers if holds(hosts, w, "far")]
        lose_for_good(hosts, builder)

        first = create(c, template="far")
        assert first["state"] == "running", first
        assert first["worker_id"] != builder
        assert run(c, first["id"], "cat /opt/mark")[0].decode().strip() == mark
        puller = first["worker_id"]
        assert holds(hosts, puller, "far")
        other = next(w for w in hosts.workers if w != puller)
        assert not holds(hosts, other, "far")

        # Once its probe says it holds the template, that host is preferred for the next one.
        deadline = time.monotonic() + 15
        while "far" not in worker_rows(hosts)[puller]["templates"]:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        second = create(c, template="far")
        assert second["worker_id"] == puller, (second, worker_rows(hosts))
        assert not holds(hosts, other, "far")

        for sb in (first, second):
            assert c.delete(f"/v1/sandboxes/{sb['id']}").status_code in (200, 202, 204)
        # Deleting the template takes it off the host that pulled it.
        assert admin.delete("/v1/templates/far").status_code == 200
        deadline = time.monotonic() + 60
        while holds(hosts, puller, "far"):
            assert time.monotonic() < deadline, hosts.logs()
            time.sleep(0.5)


def sandbox_rows(p: Platform, ids: list[str]) -> dict[str, dict[str, Any]]:
    async def read() -> dict[str, dict[str, Any]]:
        store = Store(connect(p.database_url, pool_size=1))
        try:
            return {i: dict(await store.get_sandbox(i)) for i in ids}
        finally:
            await store.close()

    return asyncio.run(read())


def fresh_host(p: Platform) -> str:
    worker_id = f"h{secrets.token_hex(3)}"
    p.add_worker(worker_id)
    wait_for_workers(p, sum(1 for _ in p.workers))
    return worker_id


def lose_for_good(p: Platform, worker_id: str) -> None:
    """The host gone, its disk with it, and the control plane has seen it go."""
    p.remove_worker(worker_id)
    deadline = time.monotonic() + 30
    while worker_rows(p)[worker_id]["state"] != "lost":
        assert time.monotonic() < deadline
        time.sleep(0.3)


def suspended_with_a_process(c: httpx.Client) -> tuple[str, str, int]:
    """A sandbox with a file and a counting process, suspended: its id, host and process."""
    sb = create(c)
    run(c, sb["id"], "echo kept > /root/file")
    pid = start_counter(c, sb["id"])
    r = c.post(f"/v1/sandboxes/{sb['id']}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    return sb["id"], sb["worker_id"], pid


def test_a_sandbox_suspended_on_a_host_lost_for_good_resumes_on_another_as_it_was(
    hosts: Platform, registry: Registry
) -> None:
    while len(hosts.workers) < 2:
        fresh_host(hosts)
    with hosts.client() as c:
        sid, home, pid = suspended_with_a_process(c)
        artifact = sandbox_rows(hosts, [sid])[sid]["artifact"]
        assert artifact and artifact.startswith(f"{registry.host}/space/sandboxes/{sid}@"), artifact

        lose_for_good(hosts, home)  # the snapshot on its disk gone with it
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "suspended"

        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 200, r.text
        moved = wait_state(c, sid, "running", timeout=120)
        assert moved["worker_id"] not in (home, None), moved
        assert f"sandbox {sid} moved from worker {home} to {moved['worker_id']}" in (
            hosts.controller.log.read_text()
        )
        assert run(c, sid, "cat /root/file")[0] == b"kept\n"
        assert counter_runs(c, sid, pid), "its process must run on where it was suspended"
        assert sandbox_rows(hosts, [sid])[sid]["artifact"] is None
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_drain_moves_what_can_leave_and_keeps_new_work_away(hosts: Platform) -> None:
    while len(hosts.workers) < 2:
        fresh_host(hosts)
    with hosts.client() as c, hosts.client(hosts.admin_key) as admin:
        made = [create(c) for _ in range(4)]
        counters = {sb["id"]: start_counter(c, sb["id"]) for sb in made}
        drained = made[0]["worker_id"]
        mine = [sb["id"] for sb in made if sb["worker_id"] == drained]
        paused = mine[-1] if len(mine) > 1 else None
        if paused:
            assert c.post(f"/v1/sandboxes/{paused}/pause").json()["state"] == "paused"
        vol = c.post("/v1/volumes", json={"name": "stays", "size_mib": 64}).json()["id"]
        held = create(c, volumes=[{"volume": vol, "path": "/data"}])
        # One with a checkpoint on the drained host: its checkpoint's files are there.
        kept = None
        for _ in range(6):
            sb = create(c)
            if sb["worker_id"] == drained:
                kept = sb["id"]
                r = c.post(f"/v1/sandboxes/{kept}/checkpoints", json={})
                assert r.status_code == 201, r.text
                break
            c.delete(f"/v1/sandboxes/{sb['id']}")
        size = admin.put(
            "/v1/templates/base/pool",
            json={"size": 2, "vcpus": 1, "memory_mib": 256, "disk_mib": 1024},
        )
        assert size.status_code == 200, size.text

        out = subprocess.run(
            [sys.executable, "-m", "space.cli.main", "admin", "drain", drained],
            env={**hosts.env, "SPACE_DATABASE_URL": hosts.database_url},
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"worker {drained} is drained" in out.stdout, out.stdout
        rows = sandbox_rows(hosts, [*counters, held["id"]])
        for sid, pid in counters.items():
            row = rows[sid]
            assert row["worker_id"] != drained, row
            if sid == paused:
                assert row["state"] == "suspended", row
                continue
            assert row["state"] == "running", row
            assert counter_runs(c, sid, pid), f"{sid} lost its process moving"
        if held["worker_id"] == drained:
            assert f"{held['id']} stays: its volumes are on this host" in out.stdout
        if kept is not None:
            assert f"{kept} stays: its checkpoints are on this host" in out.stdout
            assert sandbox_rows(hosts, [kept])[kept]["worker_id"] == drained
        # Nothing new lands there: not a create, not a pool member.
        for _ in range(2):
            assert create(c)["worker_id"] != drained
        assert all(w["state"] != "deleted" for w in sandbox_rows(hosts, [held["id"]]).values())
        deadline = time.monotonic() + 60
        while True:
            listed = {w["id"]: w for w in admin.get("/v1/workers").json()["items"]}
            if (
                listed[drained]["pool_members"] == 0
                and sum(w["pool_members"] for w in listed.values()) == 2
            ):  # let go there, refilled elsewhere
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.5)
        assert listed[drained]["draining"]
        undo = admin.delete(f"/v1/workers/{drained}/drain")
        assert undo.status_code == 200 and not undo.json()["draining"]
        admin.put(
            "/v1/templates/base/pool",
            json={"size": 0, "vcpus": 1, "memory_mib": 256, "disk_mib": 1024},
        )


def test_a_move_waits_out_a_registry_that_is_down_and_loses_nothing(
    hosts: Platform, registry: Registry
) -> None:
    """The registry stops (the fault) after a sandbox was pushed and its host is lost for good:
    the resume waits, `suspended` and saying why, never `error` or `running`; once the registry
    is back the sandbox moves and runs on, files and processes intact, within the bound."""
    while len(hosts.workers) < 2:
        fresh_host(hosts)
    with hosts.client() as c:
        sid, home, pid = suspended_with_a_process(c)
        registry.stop()
        try:
            lose_for_good(hosts, home)
            assert (
                c.post(f"/v1/sandboxes/{sid}/resume", params={"wait": "false"}).status_code == 200
            )
            seen: set[str] = set()
            until = time.monotonic() + 12
            while time.monotonic() < until:
                now = c.get(f"/v1/sandboxes/{sid}").json()
                seen.add(now["state"])
                time.sleep(0.3)
            assert seen == {"suspended"}, seen
            assert "not moved to worker" in (now["reason"] or ""), now
        finally:
            registry.start()
        moved = wait_state(c, sid, "running", timeout=60)
        assert moved["worker_id"] not in (home, None)
        assert run(c, sid, "cat /root/file")[0] == b"kept\n"
        assert counter_runs(c, sid, pid)
        c.delete(f"/v1/sandboxes/{sid}")


def volume_row(p: Platform, volume_id: str) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        store = Store(connect(p.database_url, pool_size=1))
        try:
            return dict(await store.volume(volume_id))
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_detached_volume_moves_off_a_host_lost_for_good_with_its_data(
    hosts: Platform, registry: Registry
) -> None:
    while len(hosts.workers) < 2:
        fresh_host(hosts)
    with hosts.client() as c:
        vol = c.post("/v1/volumes", json={"name": "moves", "size_mib": 64}).json()["id"]
        first = create(c, volumes=[{"volume": vol, "path": "/data"}])
        home = first["worker_id"]
        assert run(c, first["id"], "echo written on the first host > /data/note; sync")[2] == 0
        assert c.delete(f"/v1/sandboxes/{first['id']}").json()["state"] == "deleted"
        deadline = time.monotonic() + 30  # detached: pushed within the bound
        while not (artifact := volume_row(hosts, vol)["artifact"]):
            assert time.monotonic() < deadline, hosts.controller.log.read_text()[-3000:]
            time.sleep(0.5)
        assert artifact.startswith(f"{registry.host}/space/volumes/{vol}@sha256:"), artifact

        lose_for_good(hosts, home)  # the volume's image on its disk gone with it
        deadline = time.monotonic() + 60  # lost, then moved: pulled by another host first
        while volume_row(hosts, vol)["worker_id"] == home:
            assert time.monotonic() < deadline, hosts.controller.log.read_text()[-3000:]
            time.sleep(0.5)
        moved_to = volume_row(hosts, vol)["worker_id"]
        second = create(c, volumes=[{"volume": vol, "path": "/data"}])
        assert (second["state"], second["worker_id"]) == ("running", moved_to), second
        assert run(c, second["id"], "cat /data/note")[0] == b"written on the first host\n"
        assert volume_row(hosts, vol)["artifact"] is None  # attached: its push is out of date
        # Still one writer: a second sandbox writing to it is refused, wherever it would run.
        r = c.post("/v1/sandboxes", json={"volumes": [{"volume": vol, "path": "/data"}]})
        assert r.status_code == 409, r.text
        c.delete(f"/v1/sandboxes/{second['id']}")


def test_a_base_snapshot_made_on_one_host_is_pulled_by_the_next(
    hosts: Platform, registry: Registry
) -> None:
    while len(hosts.workers) < 2:
        fresh_host(hosts)
    shape = {"vcpus": 1, "memory_mib": 320}  # no other test's: its base snapshot is made now
    with hosts.client() as c, hosts.client(hosts.admin_key) as admin:
        first = create(c, **shape)
        assert first["boot"] == "cold", first  # it made the base snapshot of its shape
        made_on = first["worker_id"]
        c.delete(f"/v1/sandboxes/{first['id']}")
        tags = registry.data / "docker/registry/v2/repositories/space/snapshots/base-1-320"
        deadline = time.monotonic() + 60  # pushed in the background
        while not list(tags.glob("_manifests/tags/*")):
            assert time.monotonic() < deadline, hosts.workers[made_on].log.read_text()[-3000:]
            time.sleep(0.5)
        assert admin.post(f"/v1/workers/{made_on}/drain").status_code == 200
        try:
            second = create(c, **shape)
            assert second["worker_id"] != made_on
            assert second["boot"] == "restore", second  # pulled, not made again
            assert run(c, second["id"], "echo restored")[0] == b"restored\n"
            assert "base snapshot base-1-320 pulled" in (
                hosts.workers[second["worker_id"]].log.read_text()
            )
            c.delete(f"/v1/sandboxes/{second['id']}")
        finally:
            admin.delete(f"/v1/workers/{made_on}/drain")

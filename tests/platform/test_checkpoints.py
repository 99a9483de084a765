"""Checkpoints, rollbacks and forks on the real platform: processes and files as they were,
children that diverge, quotas, tenants kept apart, and files on the worker's disk that go with
their sandbox."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

import space
from space.client import _calls as space_calls

from ..stack import Platform
from .helpers import counter_runs, create, key_with_quotas, out, start_counter

POOL = Path("/var/lib/space/pool")


def on_disk(c: httpx.Client, sandbox_id: str) -> Path:
    """Where the sandbox's worker keeps its checkpoints (a test may have added a worker)."""
    worker_id = c.get(f"/v1/sandboxes/{sandbox_id}").json()["worker_id"]
    return POOL / "workers" / str(worker_id) / "checkpoints" / sandbox_id


def checkpoint(c: httpx.Client, sandbox_id: str, **body: str) -> dict[str, object]:
    r = c.post(f"/v1/sandboxes/{sandbox_id}/checkpoints", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def gone(path: Path, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


def test_rollback_brings_back_files_and_running_processes(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        pid = start_counter(c, sid)
        out(c, sid, "echo before > /root/a")
        ck = checkpoint(c, sid, name="clean")
        assert ck["state"] == "ready" and ck["name"] == "clean" and ck["sandbox_id"] == sid
        assert int(ck["size_bytes"]) > 0 and float(ck["paused_ms"]) > 0  # type: ignore[arg-type]
        assert (on_disk(c, sid) / str(ck["id"]) / "snapshot.json").exists()
        listed = c.get(f"/v1/sandboxes/{sid}/checkpoints").json()["items"]
        assert [k["id"] for k in listed] == [ck["id"]]
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"

        out(c, sid, f"echo after > /root/a; echo new > /root/b; kill {pid}")
        r = c.post(f"/v1/sandboxes/{sid}/checkpoints/{ck['id']}/rollback")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "running" and r.json()["id"] == sid
        assert out(c, sid, "cat /root/a") == "before\n"
        assert out(c, sid, "test -e /root/b || echo gone") == "gone\n"
        assert counter_runs(c, sid, pid)
        events = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
        assert any(e["type"] == "rollback" for e in events)

        second = checkpoint(c, sid)
        r = c.delete(f"/v1/sandboxes/{sid}/checkpoints/{ck['id']}")
        assert r.status_code == 204
        assert not (on_disk(c, sid) / str(ck["id"])).exists()
        assert c.get(f"/v1/sandboxes/{sid}/checkpoints/{ck['id']}").status_code == 404
        r = c.post(f"/v1/sandboxes/{sid}/checkpoints/{ck['id']}/rollback")
        assert r.status_code == 404

        # Deleting the sandbox deletes its checkpoints, on the worker's disk too.
        saved = on_disk(c, sid)
        assert (saved / str(second["id"])).exists()
        assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"
        assert gone(saved)
        assert c.get(f"/v1/sandboxes/{sid}/checkpoints").json()["items"] == []


def test_fork_children_diverge_while_the_parent_runs_on(platform: Platform) -> None:
    with platform.client() as c:
        parent = create(c, env={"WHO": "parent"}, metadata={"role": "parent"})["id"]
        pid = start_counter(c, parent)
        out(c, parent, "echo shared > /root/shared")
        body = {"count": 3, "env": {"WHO": "child"}, "metadata": {"role": "child"}}
        r = c.post(f"/v1/sandboxes/{parent}/fork", json=body)
        assert r.status_code == 201, r.text
        forked = r.json()
        kids = [k["id"] for k in forked["items"]]
        assert len(set(kids)) == 3 and parent not in kids
        assert forked["paused_ms"] > 0
        for k in forked["items"]:
            assert k["state"] == "running" and k["boot"] == "fork", k
            assert k["metadata"] == {"role": "child"} and k["env"]["WHO"] == "child"
        everyone = [parent, *kids]
        for sid in everyone:
            assert counter_runs(c, sid, pid), sid  # started before the fork, runs on in all
            assert out(c, sid, "cat /root/shared") == "shared\n"
        out(c, kids[0], "echo mine > /root/mine")
        for sid in [parent, *kids[1:]]:
            assert out(c, sid, "test -e /root/mine || echo no") == "no\n"
        randoms = {out(c, sid, "head -c 16 /dev/urandom | od -An -tx1") for sid in everyone}
        hostnames = {out(c, sid, "hostname") for sid in everyone}
        assert len(randoms) == 4 and len(hostnames) == 4
        assert out(c, kids[1], "echo $WHO") == "child\n"
        assert out(c, parent, "echo $WHO") == "parent\n"

        # From a checkpoint: the state then, not now.
        ck = checkpoint(c, parent)
        out(c, parent, "echo later > /root/shared")
        r = c.post(f"/v1/sandboxes/{parent}/fork", json={"checkpoint": ck["id"]})
        assert r.status_code == 201, r.text
        assert r.json()["paused_ms"] == 0
        late = r.json()["items"][0]["id"]
        assert out(c, late, "cat /root/shared") == "shared\n"
        for sid in [*kids, late, parent]:
            c.delete(f"/v1/sandboxes/{sid}")


def test_bad_requests_and_other_tenants_are_refused(platform: Platform) -> None:
    with platform.client() as a, platform.client(platform.key_b) as b:
        sid = create(a)["id"]
        ck = checkpoint(a, sid)
        base = f"/v1/sandboxes/{sid}"
        for r in (
            b.post(f"{base}/checkpoints", json={}),
            b.get(f"{base}/checkpoints"),
            b.get(f"{base}/checkpoints/{ck['id']}"),
            b.delete(f"{base}/checkpoints/{ck['id']}"),
            b.post(f"{base}/checkpoints/{ck['id']}/rollback"),
            b.post(f"{base}/fork", json={"count": 1}),
            b.post(f"{base}/fork", json={"count": 1, "checkpoint": ck["id"]}),
        ):
            assert r.status_code == 404, (r.request.url, r.text)
        assert (on_disk(a, sid) / str(ck["id"])).exists()  # none of that touched it
        for body in ({"count": 0}, {"count": 17}, {"count": "many"}, {"env": {"1x": "y"}},
                     {"surprise": 1}):  # fmt: skip
            r = a.post(f"{base}/fork", json=body)
            assert r.status_code == 422, (body, r.text)
        assert a.post(f"{base}/checkpoints", json={"name": "x" * 129}).status_code == 422
        assert a.post(f"{base}/fork", json={"checkpoint": "ck-nope"}).status_code == 404
        assert a.post(f"{base}/checkpoints/ck-nope/rollback").status_code == 404
        assert a.post(f"{base}/pause").json()["state"] == "paused"
        for r in (a.post(f"{base}/checkpoints", json={}), a.post(f"{base}/fork", json={}),
                  a.post(f"{base}/checkpoints/{ck['id']}/rollback")):  # fmt: skip
            assert r.status_code == 409, r.text
        a.delete(base)


def test_a_checkpoint_leaves_volumes_alone(platform: Platform) -> None:
    with platform.client() as c:
        vol = c.post("/v1/volumes", json={"size_mib": 64}).json()["id"]
        sid = create(c, volumes=[{"volume": vol, "path": "/data"}])["id"]
        out(c, sid, "echo one > /data/note; echo one > /root/note; sync")
        ck = checkpoint(c, sid)
        saved = on_disk(c, sid) / str(ck["id"])
        assert sorted(p.name for p in saved.iterdir() if p.suffix != ".json") == [
            "disk.img", "state.bin",
        ]  # fmt: skip
        out(c, sid, "echo two >> /data/note")
        assert out(c, sid, "cat /data/note") == "one\ntwo\n"  # it runs on, writing its volume
        r = c.post(f"/v1/sandboxes/{sid}/checkpoints/{ck['id']}/rollback")
        assert r.status_code == 400 and "volumes" in r.json()["detail"], r.text
        assert c.post(f"/v1/sandboxes/{sid}/fork", json={}).status_code == 400
        assert out(c, sid, "cat /data/note") == "one\ntwo\n"
        c.delete(f"/v1/sandboxes/{sid}")
        c.delete(f"/v1/volumes/{vol}")


def made(admin: httpx.Client, name: str, body: dict[str, object]) -> dict[str, Any]:
    """The template once its build of a checkpoint ended."""
    r = admin.post(f"/v1/templates/{name}/builds", json=body)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (tpl := admin.get(f"/v1/templates/{name}").json())["state"] in ("queued", "building"):
        assert time.monotonic() < deadline, tpl
        time.sleep(0.2)
    return dict(tpl)


def test_a_checkpoint_becomes_a_template_whose_sandboxes_start_as_it_was(
    platform: Platform,
) -> None:
    with platform.client(platform.admin_key) as admin, platform.client() as c:
        sid = create(admin, env={"WHO": "maker"})["id"]
        pid = start_counter(admin, sid)
        out(admin, sid, "echo kept > /root/kept")
        ck = checkpoint(admin, sid)
        source = {"sandbox_id": sid, "checkpoint_id": ck["id"]}
        body = {"checkpoint": source}

        # Templates are every tenant's: only admin keys make them, of their own checkpoints.
        theirs = create(c)["id"]
        their_ck = checkpoint(c, theirs)
        assert c.post("/v1/templates/ck-tpl/builds", json=body).status_code == 403
        r = admin.post("/v1/templates/ck-tpl/builds", json={"checkpoint": {
            "sandbox_id": theirs, "checkpoint_id": their_ck["id"]}})  # fmt: skip
        assert r.status_code == 404, r.text
        r = admin.post("/v1/templates/ck-tpl/builds", json={**body, "spec": "x"})
        assert r.status_code == 422, r.text
        assert admin.get("/v1/templates/ck-tpl").status_code == 404  # nothing was queued

        tpl = made(admin, "ck-tpl", body)
        assert tpl["state"] == "ready" and tpl["error"] is None, tpl
        assert str(ck["id"]) in tpl["built"]["source"]
        assert (tpl["built"]["vcpus"], tpl["built"]["memory_mib"]) == (1, 256)
        assert c.get("/v1/templates/ck-tpl").json()["built"]["vcpus"] == 1  # shown to every key
        base = POOL / "workers" / str(tpl["worker_id"]) / "base" / "ck-tpl-1-256"
        assert (base / "memory.bin").is_file()  # mapped, as every base snapshot here
        # The same through the CLI (and so the SDK), with the worker's log as progress.
        env = {**os.environ, "SPACE_API_URL": platform.api_url,
               "SPACE_API_KEY": platform.admin_key}  # fmt: skip
        cmd = [sys.executable, "-m", "space.cli.main", "checkpoint", "template", sid, ck["id"]]
        r = subprocess.run([*cmd, "ck-cli"], env=env, capture_output=True, timeout=300,
                           check=False)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().split()[0] == "ck-cli" and b"its guest must answer" in r.stderr
        assert admin.delete("/v1/templates/ck-cli").status_code == 200
        # The template has copies of what it needs: its checkpoint and sandbox may go.
        assert admin.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"

        kids = [create(c, template="ck-tpl", env={"WHO": f"kid{i}"})["id"] for i in range(2)]
        for kid in kids:
            assert counter_runs(c, kid, pid), kid  # the maker's process, running on
            assert out(c, kid, "cat /root/kept") == "kept\n"
            assert out(c, kid, "hostname") == f"{kid}\n"
        assert out(c, kids[1], "echo $WHO") == "kid1\n"  # the creator's env, not the maker's
        out(c, kids[0], "echo mine > /root/kept")
        assert out(c, kids[1], "cat /root/kept") == "kept\n"

        # Its sandboxes have the checkpoint's shape; a create asking another is told why.
        r = c.post("/v1/sandboxes", json={"template": "ck-tpl", "vcpus": 2})
        assert r.status_code == 400 and "checkpoint" in r.json()["detail"], r.text
        r = admin.put("/v1/templates/ck-tpl/pool", json={"size": 1, "memory_mib": 512})
        assert r.status_code == 400, r.text

        # A warm pool serves it, of the checkpoint's shape.
        r = admin.put("/v1/templates/ck-tpl/pool", json={"size": 1})
        assert r.status_code == 200 and r.json()["pool"]["memory_mib"] == 256, r.text
        deadline = time.monotonic() + 120
        while admin.get("/v1/templates/ck-tpl").json()["pool"]["ready"] < 1:
            assert time.monotonic() < deadline, "the pool did not fill"
            time.sleep(0.3)
        hit = create(c, template="ck-tpl")
        assert hit["boot"] == "pool", hit
        assert counter_runs(c, hit["id"], pid)
        assert out(c, hit["id"], "cat /root/kept") == "kept\n"

        # A checkpoint of a sandbox with volumes is refused (its guest has them mounted).
        vol = admin.post("/v1/volumes", json={"size_mib": 64}).json()["id"]
        with_vol = create(admin, volumes=[{"volume": vol, "path": "/data"}])["id"]
        vol_ck = checkpoint(admin, with_vol)
        r = admin.post("/v1/templates/ck-vol/builds", json={"checkpoint": {
            "sandbox_id": with_vol, "checkpoint_id": vol_ck["id"]}})  # fmt: skip
        assert r.status_code == 400 and "volumes" in r.json()["detail"], r.text
        admin.delete(f"/v1/sandboxes/{with_vol}")
        admin.delete(f"/v1/volumes/{vol}")

        for kid in [*kids, hit["id"], theirs]:
            c.delete(f"/v1/sandboxes/{kid}")
        admin.put("/v1/templates/ck-tpl/pool", json={"size": 0})
        deadline = time.monotonic() + 60
        while (r := admin.delete("/v1/templates/ck-tpl")).status_code == 409:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def tight_key(platform: Platform) -> str:
    """A tenant allowed 2 checkpoints and 3 sandboxes."""

    return key_with_quotas(platform.database_url, "ck", {"checkpoints": 2, "sandboxes": 3})


def test_checkpoints_and_forks_count_against_the_quotas(platform: Platform, tight_key: str) -> None:
    with platform.client(tight_key) as c:
        sid = create(c)["id"]
        first, _ = checkpoint(c, sid), checkpoint(c, sid)
        r = c.post(f"/v1/sandboxes/{sid}/checkpoints", json={})
        assert r.status_code == 429 and "checkpoints" in r.json()["detail"], r.text
        used = c.get("/v1/quotas").json()["used"]
        assert used["checkpoints"] == 2 and used["checkpoint_mib"] > 0
        assert len(list(on_disk(c, sid).iterdir())) == 2  # the refused one made nothing
        c.delete(f"/v1/sandboxes/{sid}/checkpoints/{first['id']}")
        checkpoint(c, sid)  # room again

        r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 3})
        assert r.status_code == 429 and "sandboxes" in r.json()["detail"], r.text
        r = c.post(f"/v1/sandboxes/{sid}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        assert c.get("/v1/quotas").json()["used"]["sandboxes"] == 3
        for k in [*r.json()["items"], {"id": sid}]:
            c.delete(f"/v1/sandboxes/{k['id']}")
        assert c.get("/v1/quotas").json()["used"]["checkpoints"] == 0


def test_sdk_and_cli(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        sb.files.write("/root/v", b"1")
        ck = sb.checkpoint("v1")
        assert isinstance(ck, space.CheckpointInfo) and ck.state == "ready"
        sb.files.write("/root/v", b"2")
        kids = sb.fork(2, env={"K": "yes"})
        assert [k.state for k in kids] == ["running", "running"]
        assert kids[0].exec("cat /root/v; echo $K").stdout == b"2yes\n"
        assert sb.rollback(ck).state == "running"
        assert sb.files.read("/root/v") == b"1"
        for k in kids:
            k.delete()

        async def go() -> None:
            async with space.AsyncSpace(platform.api_url, platform.key_a) as aclient:
                asb = await space.AsyncSandbox.get(sb.id, client=aclient)
                assert [k.id for k in await asb.checkpoints()] == [ck.id]
                (kid,) = await asb.fork(checkpoint=ck)
                assert (await kid.exec("cat /root/v")).stdout == b"1"
                await kid.delete()
                await asb.delete_checkpoint(ck)
                assert await asb.checkpoints() == []

        asyncio.run(go())

        env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}

        def cli(*args: str) -> str:
            r = subprocess.run([sys.executable, "-m", "space.cli.main", *args], env=env,
                               capture_output=True, timeout=300, check=False)  # fmt: skip
            assert r.returncode == 0, r.stderr
            return r.stdout.decode()

        made = cli("checkpoint", "create", sb.id, "--name", "cli").strip()
        assert made in cli("checkpoint", "ls", sb.id)
        (listed,) = json.loads(cli("checkpoint", "ls", sb.id, "--json"))
        assert listed["name"] == "cli"
        assert set(listed) == {
            "id",
            "sandbox_id",
            "name",
            "state",
            "size_bytes",
            "paused_ms",
            "created_at",
        }  # the keys docs/cli.md promises
        assert cli("checkpoint", "rollback", sb.id, made) == f"{sb.id} running\n"
        children = cli("fork", sb.id, "-n", "2", "--checkpoint", made).split()
        assert len(children) == 2
        for child in children:
            client._call(space_calls.delete(child))
        assert cli("checkpoint", "rm", sb.id, made) == f"{made}\n"

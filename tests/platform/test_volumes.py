"""Volumes on the real platform: data outlives sandboxes, one writer or many readers, a full
volume fails only its own writes, and volumes ride along suspend and resume."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from ..stack import Platform
from .helpers import create, run, wait_state

VOLUMES = Path("/var/lib/space/pool/volumes")


def new_volume(c: httpx.Client, size_mib: int = 64) -> str:
    r = c.post("/v1/volumes", json={"name": "data", "size_mib": size_mib})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def attach(volume: str, path: str = "/data", read_only: bool = False) -> dict[str, object]:
    return {"volume": volume, "path": path, "read_only": read_only}


def test_data_outlives_the_sandbox_and_one_writer_at_a_time(platform: Platform) -> None:
    with platform.client() as c:
        vol = new_volume(c)
        writer = create(c, volumes=[attach(vol)])
        assert writer["state"] == "running", writer
        assert writer["volumes"] == [attach(vol)]
        _, err, code = run(c, writer["id"], "echo kept > /data/note && mount | grep ' /data '")
        assert code == 0, err
        # While it writes, nobody else may attach it: not to write, not to read.
        for read_only in (False, True):
            r = c.post("/v1/sandboxes", json={"volumes": [attach(vol, read_only=read_only)]})
            assert r.status_code == 409 and writer["id"] in r.json()["detail"], r.text
        r = c.delete(f"/v1/volumes/{vol}")
        assert r.status_code == 409 and writer["id"] in r.json()["detail"]
        c.delete(f"/v1/sandboxes/{writer['id']}")

        # Readers see what the writer left, and cannot change it; several may read at once.
        readers = [create(c, volumes=[attach(vol, "/mnt/v", read_only=True)]) for _ in range(2)]
        for sb in readers:
            assert sb["state"] == "running", sb
            out, _, code = run(c, sb["id"], "cat /mnt/v/note")
            assert (out, code) == (b"kept\n", 0)
            _, err, code = run(c, sb["id"], "echo no > /mnt/v/note")
            assert code != 0 and b"Read-only" in err, err
        r = c.post("/v1/sandboxes", json={"volumes": [attach(vol)]})
        assert r.status_code == 409 and "read-only" in r.json()["detail"]
        for sb in readers:
            c.delete(f"/v1/sandboxes/{sb['id']}")

        # Deleting the volume removes its image once no sandbox has it.
        assert (VOLUMES / f"{vol}.img").exists()
        r = c.delete(f"/v1/volumes/{vol}")
        assert r.status_code == 200 and r.json()["state"] in ("deleting", "deleted")
        deadline = time.monotonic() + 10
        while (VOLUMES / f"{vol}.img").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not (VOLUMES / f"{vol}.img").exists()
        assert c.get(f"/v1/volumes/{vol}").status_code == 404


def test_a_full_volume_fails_only_its_own_writes(platform: Platform) -> None:
    with platform.client() as c:
        vol = new_volume(c, size_mib=32)
        sb = create(c, volumes=[attach(vol)])
        _, err, code = run(c, sb["id"], "dd if=/dev/zero of=/data/fill bs=1M count=64")
        assert code != 0 and b"No space left" in err, err
        # The sandbox's own disk is untouched by it.
        _, err, code = run(c, sb["id"], "dd if=/dev/zero of=/root/ok bs=1M count=8 && sync")
        assert code == 0, err
        c.delete(f"/v1/sandboxes/{sb['id']}")
        assert c.delete(f"/v1/volumes/{vol}").status_code == 200


def test_a_volume_rides_along_suspend_and_resume(platform: Platform) -> None:
    with platform.client() as c:
        vol = new_volume(c)
        sb = create(c, volumes=[attach(vol)])
        run(c, sb["id"], "echo before > /data/x")
        assert c.post(f"/v1/sandboxes/{sb['id']}/suspend").json()["state"] == "suspended"
        # Suspended, it still holds the volume: no writer may come in meanwhile.
        r = c.post("/v1/sandboxes", json={"volumes": [attach(vol)]})
        assert r.status_code == 409
        assert c.post(f"/v1/sandboxes/{sb['id']}/resume").json()["state"] == "running"
        out, _, code = run(c, sb["id"], "cat /data/x && echo after >> /data/x && cat /data/x")
        assert (out, code) == (b"before\nbefore\nafter\n", 0)
        c.delete(f"/v1/sandboxes/{sb['id']}")
        # The next sandbox sees every write, including those made after the resume.
        nxt = create(c, volumes=[attach(vol, "/srv")])
        out, _, _ = run(c, nxt["id"], "cat /srv/x")
        assert out == b"before\nafter\n"
        c.delete(f"/v1/sandboxes/{nxt['id']}")
        wait_state(c, nxt["id"], "deleted")
        assert c.delete(f"/v1/volumes/{vol}").status_code == 200


def test_bad_volume_requests_are_refused(platform: Platform) -> None:
    with platform.client() as a, platform.client(platform.key_b) as b:
        vol = new_volume(a)
        # Another tenant's volume does not exist for B.
        r = b.post("/v1/sandboxes", json={"volumes": [attach(vol)]})
        assert r.status_code == 404 and vol in r.json()["detail"]
        assert b.get(f"/v1/volumes/{vol}").status_code == 404
        assert b.delete(f"/v1/volumes/{vol}").status_code == 404
        for bad in (
            [attach(vol, "relative")],
            [attach(vol, "/")],
            [attach(vol, "/proc/x")],
            [attach(vol, "/run")],
            [attach(vol), attach(vol, "/other")],
            [attach(vol, "/a"), attach("vol-x", "/a")],
            [attach(vol, "/a"), attach("vol-x", "/b"), attach("vol-y", "/c")],
        ):
            r = a.post("/v1/sandboxes", json={"volumes": bad})
            assert r.status_code == 422, (bad, r.text)
        for body in ({"size_mib": 1}, {"size_mib": 10**9}, {"size": 5}):
            assert a.post("/v1/volumes", json=body).status_code == 422
        assert a.delete(f"/v1/volumes/{vol}").status_code == 200
        r = a.post("/v1/sandboxes", json={"volumes": [attach(vol)]})
        assert r.status_code == 404  # deleted

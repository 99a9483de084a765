"""The sandbox lifecycle through the HTTP API, end to end against the real stack."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import wsproto.events
from httpx_ws import connect_ws

from ..stack import Platform
from .helpers import counter_runs, create, exec_events, run, start_counter, wait_state

pytestmark = pytest.mark.vm


def test_create_exec_files_pause_resume_suspend_resume_delete(platform: Platform) -> None:
    with platform.client() as c:
        sb = create(c, metadata={"suite": "lifecycle"}, env={"GREETING": "hello"})
        assert sb["state"] == "running", sb
        sid = sb["id"]

        out, err, code = run(c, sid, 'echo "$GREETING"; echo oops >&2; exit 3')
        assert (out, err, code) == (b"hello\n", b"oops\n", 3)
        events = exec_events(c, sid, argv=["true"])
        assert [e["type"] for e in events] == ["start", "exit"]

        data = os.urandom(3 << 20)
        r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/data.bin"}, content=data)
        assert r.status_code == 200 and r.json()["size"] == len(data)
        got = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/data.bin"})
        assert hashlib.sha256(got.content).digest() == hashlib.sha256(data).digest()
        names = [e["name"] for e in c.get(f"/v1/sandboxes/{sid}/files/list",
                                          params={"path": "/root"}).json()["entries"]]  # fmt: skip
        assert "data.bin" in names
        missing = c.get(f"/v1/sandboxes/{sid}/files/stat", params={"path": "/nope"})
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"

        pid = start_counter(c, sid)
        assert c.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
        assert c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 409
        assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        assert counter_runs(c, sid, pid)

        assert c.post(f"/v1/sandboxes/{sid}/suspend").json()["state"] == "suspended"
        assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        assert counter_runs(c, sid, pid), "a process started before suspend must survive it"
        again = c.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/data.bin"})
        assert hashlib.sha256(again.content).digest() == hashlib.sha256(data).digest()

        assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"  # kept for audit
        states = [e["to_state"] for e in c.get(f"/v1/sandboxes/{sid}/events").json()["items"]]
        for s in ("pending", "starting", "running", "pausing", "paused", "suspending",
                  "suspended", "resuming", "deleting", "deleted"):  # fmt: skip
            assert s in states, (s, states)


def test_illegal_transitions_answer_409_with_the_state(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 409 and r.json()["state"] == "running"
        c.post(f"/v1/sandboxes/{sid}/pause")
        r = c.post(f"/v1/sandboxes/{sid}/pause")
        assert r.status_code == 409 and r.json()["state"] == "paused"
        c.delete(f"/v1/sandboxes/{sid}")
        r = c.post(f"/v1/sandboxes/{sid}/resume")
        assert r.status_code == 409 and r.json()["state"] == "deleted"


def test_idempotent_create_and_client_chosen_ids(platform: Platform) -> None:
    with platform.client() as c:
        key = {"Idempotency-Key": os.urandom(8).hex()}
        first = c.post("/v1/sandboxes", json={}, headers=key)
        second = c.post("/v1/sandboxes", json={}, headers=key)
        assert first.status_code == 201 and second.status_code == 200
        assert first.json()["id"] == second.json()["id"]
        chosen = f"mine-{os.urandom(4).hex()}"
        mine = create(c, id=chosen)["id"]
        assert mine.startswith(f"{chosen}-")
        again = c.post("/v1/sandboxes", json={"id": chosen})
        assert again.status_code == 200 and again.json()["id"] == mine
        for sid in (first.json()["id"], mine):
            c.delete(f"/v1/sandboxes/{sid}")


def test_list_filters_and_pagination(platform: Platform) -> None:
    with platform.client() as c:
        tag = os.urandom(4).hex()
        made = [create(c, metadata={"tag": tag}, **{"id": f"ls-{tag}-{i}"})["id"] for i in range(3)]
        ids = set(made)
        c.post(f"/v1/sandboxes/{made[0]}/pause")
        page = c.get("/v1/sandboxes", params={"metadata.tag": tag, "limit": 2}).json()
        assert len(page["items"]) == 2 and page["next_cursor"]
        rest = c.get("/v1/sandboxes", params={"metadata.tag": tag, "cursor": page["next_cursor"]})
        assert {s["id"] for s in page["items"] + rest.json()["items"]} == ids
        paused = c.get("/v1/sandboxes", params={"metadata.tag": tag, "state": "paused"}).json()
        assert [s["id"] for s in paused["items"]] == [made[0]]
        for sid in ids:
            c.delete(f"/v1/sandboxes/{sid}", params={"wait": "false"})


def test_timeout_pauses_or_deletes_as_asked(platform: Platform) -> None:
    with platform.client() as c:
        pausing = create(c, timeout_s=2, timeout_action="pause")["id"]
        deleting = create(c, timeout_s=2, timeout_action="delete")["id"]
        paused = wait_state(c, pausing, "paused", timeout=30)
        wait_state(c, deleting, "deleted", timeout=30)
        # Resuming restarts the timer: it is not paused again at once for the old deadline.
        resumed = c.post(f"/v1/sandboxes/{pausing}/resume").json()
        assert resumed["state"] == "running"
        assert resumed["expires_at"] > paused["expires_at"]
        r = c.put(f"/v1/sandboxes/{pausing}/timeout", json={"timeout_s": 600})
        assert r.status_code == 200 and r.json()["timeout_s"] == 600
        c.delete(f"/v1/sandboxes/{pausing}")


def test_interactive_exec_over_websocket_with_a_pty(platform: Platform) -> None:
    with platform.client() as c:
        sid = create(c)["id"]
        out = b""
        with connect_ws(
            f"{platform.api_url}/v1/sandboxes/{sid}/exec/ws".replace("http", "ws", 1), c
        ) as ws:
            ws.send_text(json.dumps({"argv": ["sh"], "pty": True, "rows": 30, "cols": 90}))
            assert json.loads(ws.receive_text())["type"] == "start"
            ws.send_bytes(b"stty size; tty; exit 3\n")
            while True:
                msg = ws.receive()
                if isinstance(msg, wsproto.events.BytesMessage):
                    assert msg.data[0] == 1  # a PTY has one stream
                    out += bytes(msg.data[1:])
                elif isinstance(msg, wsproto.events.TextMessage):
                    event = json.loads(msg.data)
                    if event["type"] == "exit":
                        break
                else:
                    break
        assert b"30 90" in out and b"/dev/pts/" in out
        assert event["exit_code"] == 3
        c.delete(f"/v1/sandboxes/{sid}")


def test_disk_size_is_the_sandboxes_quota(platform: Platform) -> None:
    with platform.client() as c:
        big = create(c, disk_mib=2048)
        small = create(c)
        try:
            assert big["state"] == "running", big
            size_mib = int(run(c, big["id"], "df -m --output=size / | tail -1")[0])
            assert 1800 < size_mib <= 2048, size_mib
            # Past its size the sandbox's own writes fail; nobody else notices.
            _, err, code = run(c, big["id"], "fallocate -l 3G /root/too-big")
            assert code != 0 and b"No space left" in err
            # (a failed fallocate may keep what it got: clear it first)
            out, err, code = run(c, big["id"], "rm -f /root/too-big; fallocate -l 1500M /root/fits")
            assert code == 0, (out, err)
            _, err, code = run(c, big["id"], "head -c 900M /dev/zero > /root/more")
            assert code != 0 and b"No space left" in err
            assert run(c, small["id"], "echo fine > /root/ok && cat /root/ok")[0] == b"fine\n"
            assert run(c, big["id"], "rm /root/more /root/fits && echo freed")[0] == b"freed\n"
            too_small = create(c, disk_mib=512)
            assert too_small["state"] == "error" and "smaller than template" in too_small["reason"]
        finally:
            for sb in (big, small):
                c.delete(f"/v1/sandboxes/{sb['id']}")

"""What a sandbox streams to a follower: its serial console through the API, the SDK and
`space sandbox logs` (its past, then what the guest writes as it comes, until its VM stops;
bounds refused clearly), and its lifecycle events pushed as they happen until it is deleted."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import space
from space.api.deps import FOLLOWERS_PER_TENANT

from ..stack import Platform
from .helpers import run


def test_the_console_is_read_then_followed_until_the_vm_stops(platform: Platform) -> None:
    with platform.client() as c, space.Space(platform.api_url, platform.key_a) as client:
        sb = space.Sandbox.create(client=client)
        assert run(c, sb.id, "echo first-line > /dev/console")[2] == 0
        past = "".join(sb.logs())
        assert "first-line" in past
        assert len("".join(sb.logs(tail=5)).encode()) <= 5
        for bad in ({"tail": "-1"}, {"tail": str(2 << 20)}, {"follow": "maybe"}):
            r = c.get(f"/v1/sandboxes/{sb.id}/logs", params=bad)
            assert r.status_code == 422 and "Traceback" not in r.text, (bad, r.text)

        env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
        follower = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "sandbox", "logs", sb.id, "-f", "--tail", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            time.sleep(1)
            assert run(c, sb.id, "echo second-line > /dev/console")[2] == 0
            assert follower.stdout is not None
            line = follower.stdout.readline()
            while "second-line" not in line:
                assert line, follower.stderr.read() if follower.stderr else ""
                line = follower.stdout.readline()
            assert c.post(f"/v1/sandboxes/{sb.id}/pause").status_code == 200  # still there
            assert follower.poll() is None
            assert c.delete(f"/v1/sandboxes/{sb.id}").status_code == 200
            assert follower.wait(timeout=30) == 0  # its VM stopped: the console ended
        finally:
            follower.kill()
        r = c.get(f"/v1/sandboxes/{sb.id}/logs")
        assert r.status_code == 409 and "deleted" in r.json()["detail"]
        with platform.client(platform.key_b) as b:
            assert b.get(f"/v1/sandboxes/{sb.id}/logs").status_code == 404


def test_events_are_pushed_as_they_happen_until_it_is_deleted(platform: Platform) -> None:
    with platform.client() as c:
        sid = c.post("/v1/sandboxes", json={}).json()["id"]
        seen = c.get(f"/v1/sandboxes/{sid}/events").json()["items"]
        got: queue.Queue[dict[str, Any] | None] = queue.Queue()

        def follow() -> None:
            params = {"follow": "true", "after": str(seen[-1]["id"])}
            with platform.client() as f, f.stream("GET", f"/v1/sandboxes/{sid}/events",
                                                  params=params) as r:  # fmt: skip
                assert r.headers["content-type"].startswith("application/x-ndjson")
                for line in r.iter_lines():
                    got.put(json.loads(line))
            got.put(None)  # the stream ended

        threading.Thread(target=follow, daemon=True).start()
        time.sleep(1)
        assert got.empty()  # nothing new yet: nothing sent again
        assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200

        def until(state: str) -> list[dict[str, Any]]:
            events = []
            while True:
                e = got.get(timeout=30)  # pushed within seconds, not at a poll's pace
                assert e is not None, events
                events.append(e)
                if e["type"] == "state" and e["to_state"] == state:
                    return events

        paused = until("paused")
        assert paused[0]["type"] == "requested" and paused[0]["to_state"] == "paused"
        assert c.delete(f"/v1/sandboxes/{sid}").status_code == 200
        until("deleted")
        assert got.get(timeout=10) is None  # and then it ends
        ids = [e["id"] for e in c.get(f"/v1/sandboxes/{sid}/events").json()["items"]]
        later = c.get(f"/v1/sandboxes/{sid}/events", params={"after": ids[-2]}).json()["items"]
        assert [e["id"] for e in later] == ids[-1:]


def test_a_tenant_follows_a_bounded_number_of_streams_at_once(platform: Platform) -> None:
    """Each followed stream holds a connection for as long as it lasts: past its share a
    tenant is told to end one first (429), and a stream it left frees its place."""
    with platform.client(platform.key_b) as c:
        sid = c.post("/v1/sandboxes", json={}).json()["id"]
        last = str(c.get(f"/v1/sandboxes/{sid}/events").json()["items"][-1]["id"])
        follow = {"follow": "true", "after": last}
        with contextlib.ExitStack() as streams:
            for i in range(FOLLOWERS_PER_TENANT):
                path = f"/v1/sandboxes/{sid}/" + ("logs" if i % 2 else "events")
                r = streams.enter_context(c.stream("GET", path, params=follow))
                assert r.status_code == 200, r.read()
            r = c.get(f"/v1/sandboxes/{sid}/events", params=follow)
            assert r.status_code == 429 and "end one" in r.json()["detail"], r.text
            with platform.client(platform.key_a) as a:  # another tenant's share is its own
                mine = a.post("/v1/sandboxes", json={}).json()["id"]
                with a.stream(
                    "GET", f"/v1/sandboxes/{mine}/events", params={"follow": "true"}
                ) as r:
                    assert r.status_code == 200
                a.delete(f"/v1/sandboxes/{mine}")
        deadline = time.monotonic() + 10
        while True:  # left: their places come back as the API sees them go
            with c.stream("GET", f"/v1/sandboxes/{sid}/events", params=follow) as r:
                if r.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the places of streams that ended stayed taken"
            time.sleep(0.2)
        c.delete(f"/v1/sandboxes/{sid}")

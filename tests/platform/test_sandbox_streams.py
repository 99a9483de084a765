"""What a sandbox streams to a follower: its serial console through the API, the SDK and
`space sandbox logs` (its past, then what the guest writes as it comes, until its VM stops;
bounds refused clearly), and its lifecycle events pushed as they happen until it is deleted."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any

import space

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

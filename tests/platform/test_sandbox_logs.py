"""A sandbox's serial console through the API, the SDK and `space sandbox logs`: its past, then
(following) what the guest writes as it comes, until its VM stops; bounds refused clearly."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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

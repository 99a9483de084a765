"""File watches through the API and the SDK, in a real VM: set before the call returns, every
kind of change told, stopped in the guest when the client leaves, nobody else's to open."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

import space

from ..stack import Platform

pytestmark = pytest.mark.vm

INOTIFY_FDS = "ls -l /proc/1/fd | grep -c anon_inode:inotify || true"  # the agent is PID 1


def _inotify_fds(sb: space.Sandbox) -> int:
    return int(sb.exec(INOTIFY_FDS).text.strip())


def test_a_watch_tells_what_changes_and_stops_when_left(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        sb.files.mkdir("/root/w")
        before = _inotify_fds(sb)
        with sb.files.watch("/root/w", recursive=True) as watch:
            assert _inotify_fds(sb) == before + 1
            sb.exec("cd /root/w && echo 1 > a && mkdir -p d/e && echo 2 > d/e/b && mv a c && rm c")
            sb.files.write("/root/w/d/e/b", "3")  # an atomic write: a new name moved over
            sb.files.rename("/root/w/d/e/b", "/root/w/moved")
            seen: list[tuple[str, str | None, bool]] = []
            for event in watch:
                seen.append((event.type, event.path, event.is_dir))
                if ("create", "/root/w/moved", False) in seen:
                    break
        expected = [
            ("create", "/root/w/a", False), ("rename", "/root/w/a", False),
            ("create", "/root/w/c", False), ("remove", "/root/w/c", False),
            ("create", "/root/w/d", True), ("create", "/root/w/d/e/b", False),
            ("rename", "/root/w/d/e/b", False), ("create", "/root/w/moved", False),
        ]  # fmt: skip
        assert [e for e in expected if e not in seen] == [], seen
        deadline = time.monotonic() + 15
        while _inotify_fds(sb) != before:  # leaving the stream stopped the watch in the guest
            assert time.monotonic() < deadline, "the guest still watches after the client left"
            time.sleep(0.3)


async def test_async_watch_and_its_end(platform: Platform) -> None:
    async with space.AsyncSpace(platform.api_url, platform.key_a) as client:
        sb = await space.AsyncSandbox.create(client=client)
        try:
            await sb.files.mkdir("/tmp/gone")
            async with await sb.files.watch("/tmp/gone") as watch:
                await sb.exec("touch /tmp/gone/x && rm -r /tmp/gone")
                # touch also sets the times (a chmod event): only names are asserted here
                kinds = [(e.type, e.path) async for e in watch if e.type != "chmod"]
            assert kinds == [("create", "/tmp/gone/x"), ("remove", "/tmp/gone/x")], kinds
            assert watch.ended == "removed"
        finally:
            await sb.delete()


def test_watches_are_the_tenants_own_and_bad_ones_refused(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
        space.Space(platform.api_url, platform.key_b) as other,
    ):
        with pytest.raises(space.NotFoundError):
            space.Sandbox(other, sb.info).files.watch("/root")
        with pytest.raises(space.NotFoundError):
            sb.files.watch("/no/such/dir")
        with pytest.raises(space.ValidationError):
            sb.files.watch("/etc/hostname")  # a file, not a directory
        raw = httpx.get(
            f"{platform.api_url}/v1/sandboxes/{sb.id}/files/watch",
            params={"path": "relative"},
            headers={"Authorization": f"Bearer {platform.key_a}"},
        )
        assert raw.status_code == 422 and "path" in raw.text
        assert sb.exec("true").exit_code == 0  # the sandbox is untouched


def test_cli_watch(platform: Platform) -> None:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        sb.files.mkdir("/root/cli")
        cli = subprocess.Popen(
            [sys.executable, "-m", "space.cli.main", "watch", sb.id, "/root/cli", "--json"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            assert cli.stderr is not None and cli.stdout is not None
            assert cli.stderr.readline().startswith(b"watching ")  # set from here on
            sb.exec("mkdir /root/cli/made")
            assert json.loads(cli.stdout.readline()) == {
                "type": "create", "path": "/root/cli/made", "is_dir": True,
            }  # fmt: skip
            cli.send_signal(signal.SIGINT)
            assert cli.wait(30) == 0
        finally:
            cli.kill()
            cli.wait()
        missing = subprocess.run(
            [sys.executable, "-m", "space.cli.main", "watch", sb.id, "/nope"],
            env=env, capture_output=True, timeout=120,
        )  # fmt: skip
        assert missing.returncode == 1 and b"Traceback" not in missing.stderr, missing.stderr

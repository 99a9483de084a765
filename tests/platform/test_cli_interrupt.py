"""Every long-running command stops on Ctrl-C, at once and cleanly: SIGINT sent for real to the
`space` process at the moment it is busiest (following output, watching, forwarding, waiting
for an answer), and with the API frozen (SIGSTOP) so that no clean-up call can be answered."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ..stack import Platform
from .helpers import create, run

pytestmark = pytest.mark.vm

STOPPED_WITHIN_S = 5.0  # the command's own clean-up has 2 s (space.cli.interrupt), then it goes


def started(platform: Platform, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
    return subprocess.Popen(
        [sys.executable, "-m", "space.cli.main", *args], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def wait_for(stream: object, text: bytes) -> None:
    """Until a line holding `text` came (the command is past its start and busy)."""
    assert hasattr(stream, "readline")
    seen = []
    while line := stream.readline():
        seen.append(line)
        if text in line:
            return
    raise AssertionError(f"never printed {text!r}: {b''.join(seen)[-2000:]!r}")


def interrupt(cli: subprocess.Popen[bytes]) -> tuple[int, float, bytes]:
    """SIGINT, then its exit status, how long it took to end, and what it wrote to stderr."""
    sent = time.monotonic()
    cli.send_signal(signal.SIGINT)
    try:
        status = cli.wait(30)
    finally:
        cli.kill()
    took = time.monotonic() - sent
    assert cli.stderr is not None
    return status, took, cli.stderr.read()


@contextlib.contextmanager
def frozen(platform: Platform) -> Iterator[None]:
    """The API stopped by SIGSTOP: connections stay open, nothing is answered."""
    os.kill(platform.api.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(platform.api.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def sandbox_id(platform: Platform) -> Iterator[str]:
    with platform.client() as c:
        sid = str(create(c)["id"])
        assert run(c, sid, "mkdir -p /root/w; echo console-ready > /dev/console")[2] == 0
        yield sid
        c.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("freeze", [False, True], ids=["answering", "api-frozen"])
@pytest.mark.parametrize(
    ("args", "ready", "where"),
    [
        (("watch", "{sid}", "/root/w"), b"watching", "stderr"),
        (("exec", "{sid}", "--", "sh", "-c", "echo ready; sleep 600"), b"ready", "stdout"),
        (("process", "attach", "{sid}", "sleeper"), b"slept", "stdout"),
        (("forward", "{sid}", "8080", "--local-port", "0"), b"forwarding", "stderr"),
        (("sandbox", "logs", "{sid}", "-f"), b"console-ready", "stdout"),
    ],
    ids=["watch", "exec", "attach", "forward", "logs"],
)
def test_ctrl_c_stops_a_long_running_command_at_once(
    platform: Platform, sandbox_id: str, args: tuple[str, ...], ready: bytes, where: str,
    freeze: bool,
) -> None:  # fmt: skip
    if args[:2] == ("process", "attach"):
        with platform.client() as c:
            body = {"cmd": "echo slept; sleep 600", "tag": "sleeper"}
            r = c.post(f"/v1/sandboxes/{sandbox_id}/processes", json=body)
            assert r.status_code in (200, 201, 409), r.text  # 409: started by the other case
    cli = started(platform, *(a.format(sid=sandbox_id) for a in args))
    wait_for(cli.stdout if where == "stdout" else cli.stderr, ready)
    with frozen(platform) if freeze else contextlib.nullcontext():
        status, took, err = interrupt(cli)
    assert took < STOPPED_WITHIN_S, (took, err[-2000:])
    assert status in (0, 130), (status, err[-2000:])
    assert b"Traceback" not in err, err[-2000:]


def test_a_forward_stops_with_a_request_in_flight_to_a_frozen_api(
    platform: Platform, sandbox_id: str
) -> None:
    """The forwarder's server would wait for the request it is serving, which never ends."""
    cli = started(platform, "forward", sandbox_id, "8080", "--local-port", "0")
    assert cli.stderr is not None
    line = cli.stderr.readline().decode()
    port = int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
    with frozen(platform), socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.5)  # in the forwarder, waiting on the API
        status, took, err = interrupt(cli)
    assert took < STOPPED_WITHIN_S, (took, err[-2000:])
    assert status in (0, 130), (status, err[-2000:])


def test_a_second_ctrl_c_stops_it_without_waiting(platform: Platform, sandbox_id: str) -> None:
    cli = started(platform, "exec", sandbox_id, "--", "sh", "-c", "echo ready; sleep 600")
    wait_for(cli.stdout, b"ready")
    with frozen(platform):
        cli.send_signal(signal.SIGINT)
        time.sleep(0.2)
        status, took, err = interrupt(cli)
    assert took < 1.0 and status == 130, (took, status, err[-2000:])

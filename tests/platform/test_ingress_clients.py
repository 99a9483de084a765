"""Ingress from the SDK (`sandbox.request`, `port_url`) and the CLI (`space forward`), in real
VMs: the service's own answers come back whatever their status, the API's refusals raise, and a
forwarded local port needs no key but carries the caller's, streaming a body both ways."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

import space

from ..stack import Platform, free_port
from .test_egress import STREAMER

pytestmark = pytest.mark.vm


def _serve(sb: space.Sandbox) -> None:
    """The streamer on port 8002, http.server (whose 404s are its own) on 8000."""
    sb.files.write("/root/streamer.py", STREAMER)
    sb.processes.start(["python3", "/root/streamer.py"], tag="streamer")
    sb.processes.start(["python3", "-m", "http.server", "-d", "/root", "8000"], tag="files")
    deadline = time.monotonic() + 30
    while True:
        try:
            sb.request(8002, "GET", "/1")
            sb.request(8000, "GET", "/")
            return
        except space.APIError as e:
            assert e.status == 502 and time.monotonic() < deadline, e
            time.sleep(0.3)


def test_sdk_requests_reach_the_service_and_its_errors_are_its_own(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
        space.Space(platform.api_url, platform.key_b) as other,
    ):
        _serve(sb)
        r = sb.request(8002, "GET", "/5")
        assert r.status_code == 200 and r.content == b"xxxxx"
        # The service said its length: the client is told it too, not a chunked stream.
        assert r.headers["content-length"] == "5" and "transfer-encoding" not in r.headers
        r = sb.request(8000, "HEAD", "/streamer.py")  # the length of what a GET would bring
        assert r.status_code == 200 and r.content == b""
        assert r.headers["content-length"] == str(len(STREAMER.encode()))
        r = sb.request(8002, "POST", "sum", content=b"abc")
        assert r.text == f"3 {hashlib.sha256(b'abc').hexdigest()}"
        # The service's own error is an answer, not an exception: not an API error.
        r = sb.request(8000, "GET", "/missing")
        assert r.status_code == 404 and r.headers.get("via") == "1.1 space"
        with pytest.raises(space.APIError) as nothing:
            sb.request(8003, "GET", "/")
        assert nothing.value.status == 502 and "8003" in str(nothing.value)
        with pytest.raises(space.NotFoundError):
            space.Sandbox(other, sb.info).request(8002, "GET", "/1")
        url = sb.port_url(8002, "/7")
        assert url == f"{platform.api_url}/v1/sandboxes/{sb.id}/ports/8002/7"
        assert httpx.get(url).status_code == 401  # the URL alone lets nobody in
        assert httpx.get(url, headers={"Authorization": f"Bearer {platform.key_a}"}).text == "x" * 7


async def test_async_requests(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        _serve(sb)
        async with space.AsyncSpace(platform.api_url, platform.key_a) as aclient:
            asb = await space.AsyncSandbox.get(sb.id, client=aclient)
            r = await asb.request(8002, "GET", "/3")
            assert r.content == b"xxx"
            with pytest.raises(space.APIError):
                await asb.request(8003)


def test_space_forward_serves_a_port_locally(platform: Platform) -> None:
    env = {**os.environ, "SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        _serve(sb)
        local = free_port()
        cli = [sys.executable, "-m", "space.cli.main", "forward", sb.id, "8002", "-l", str(local)]
        forward = subprocess.Popen(cli, env=env, stderr=subprocess.PIPE)
        try:
            assert forward.stderr is not None
            assert b"forwarding http://127.0.0.1:" in forward.stderr.readline()
            base = f"http://127.0.0.1:{local}"
            assert httpx.get(f"{base}/4").content == b"xxxx"  # no key needed locally
            size = 8 << 20
            with httpx.stream("GET", f"{base}/{size}", timeout=120) as down:
                assert sum(len(chunk) for chunk in down.iter_bytes()) == size
            block = os.urandom(1 << 20)
            up = httpx.post(f"{base}/sum", content=(block for _ in range(8)), timeout=120)
            assert up.text == f"{size} {hashlib.sha256(block * 8).hexdigest()}"
            # Nothing listening behind it: the API's refusal, said plainly.
            nothing = subprocess.Popen([*cli[:-3], "8003", "-l", str(free_port())], env=env,
                                       stderr=subprocess.PIPE)  # fmt: skip
            try:
                assert nothing.stderr is not None
                line = nothing.stderr.readline().decode()
                port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                r = httpx.get(f"http://127.0.0.1:{port}/")
                assert r.status_code == 502 and "8003" in r.text
            finally:
                nothing.terminate()
                nothing.wait(10)
            taken = subprocess.run(cli, env=env, capture_output=True, timeout=60)
            assert taken.returncode != 0 and b"cannot listen" in taken.stderr
        finally:
            forward.send_signal(signal.SIGINT)  # Ctrl-C
            assert forward.wait(10) == 0
            assert forward.stderr is not None and b"Traceback" not in forward.stderr.read()

"""A real OCI registry (Debian's docker-registry) for the tests: open, or with the auth given."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.templates.helpers import Pusher


@dataclass
class Registry:
    host: str  # host:port, as in image references
    url: str
    pusher: Pusher
    data: Path  # its storage: what was pushed, for a test to look at


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def serve_registry(
    tmp: Path, auth: str = "", pusher_headers: dict[str, str] | None = None,
    basic: tuple[str, str] | None = None, address: str = "127.0.0.1",
) -> Iterator[Registry]:  # fmt: skip
    """The registry on `address` until the generator is closed; its storage under `tmp`."""
    if shutil.which("docker-registry") is None:
        pytest.fail("docker-registry is not installed (make deps)")
    port = _free_port(address)
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {address}:{port}\n" + auth
    )
    log = (tmp / "registry.log").open("wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://{address}:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"docker-registry did not start: {(tmp / 'registry.log').read_text()}")
            time.sleep(0.05)
        pusher = Pusher(url, basic, pusher_headers)
        yield Registry(host=f"{address}:{port}", url=url, pusher=pusher, data=tmp / "data")
        pusher.close()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()

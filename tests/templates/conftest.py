"""A real OCI registry (Debian's docker-registry) on localhost, open and with htpasswd auth."""

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

USER, PASSWORD = "alice", "s3cret-pw"


@dataclass
class Registry:
    host: str  # host:port, as in image references
    url: str
    pusher: Pusher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(tmp: Path, htpasswd: Path | None) -> Iterator[Registry]:
    if shutil.which("docker-registry") is None:
        pytest.fail("docker-registry is not installed (make deps)")
    port = _free_port()
    auth = f"auth:\n  htpasswd:\n    realm: space-test\n    path: {htpasswd}\n" if htpasswd else ""
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n" + auth
    )
    log = (tmp / "registry.log").open("wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
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
        pusher = Pusher(url, (USER, PASSWORD) if htpasswd else None)
        yield Registry(host=f"127.0.0.1:{port}", url=url, pusher=pusher)
        pusher.close()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An open registry."""
    yield from _serve(tmp_path_factory.mktemp("registry"), None)


@pytest.fixture(scope="session")
def private_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry that wants USER/PASSWORD (htpasswd, bcrypt)."""
    tmp = tmp_path_factory.mktemp("private-registry")
    htpasswd = tmp / "htpasswd"
    subprocess.run(
        ["htpasswd", "-B", "-b", "-c", str(htpasswd), USER, PASSWORD],
        check=True,
        capture_output=True,
    )
    yield from _serve(tmp, htpasswd)

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
from tests.templates.token_server import TokenService

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


def _serve(
    tmp: Path, auth: str = "", pusher_headers: dict[str, str] | None = None, basic: bool = False
) -> Iterator[Registry]:
    if shutil.which("docker-registry") is None:
        pytest.fail("docker-registry is not installed (make deps)")
    port = _free_port()
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
        pusher = Pusher(url, (USER, PASSWORD) if basic else None, pusher_headers)
        yield Registry(host=f"127.0.0.1:{port}", url=url, pusher=pusher)
        pusher.close()
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An open registry."""
    yield from _serve(tmp_path_factory.mktemp("registry"))


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
    auth = f"auth:\n  htpasswd:\n    realm: space-test\n    path: {htpasswd}\n"
    yield from _serve(tmp, auth, basic=True)


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry with token auth: Bearer tokens from a token service that wants USER/PASSWORD."""
    tmp = tmp_path_factory.mktemp("token-registry")
    tokens = TokenService(tmp, USER, PASSWORD)
    push = {"Authorization": f"Bearer {tokens.token('repository:secret/app:pull,push')}"}
    try:
        yield from _serve(tmp, tokens.registry_auth(), push)
    finally:
        tokens.close()

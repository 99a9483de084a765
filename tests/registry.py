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
    config: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Serve (again, on the same address and storage) until it answers."""
        with (self.config.parent / "registry.log").open("ab") as log:
            self.proc = subprocess.Popen(
                ["docker-registry", "serve", str(self.config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{self.url}/v2/", timeout=1).status_code in (200, 401):
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("docker-registry did not start: "
                            f"{(self.config.parent / 'registry.log').read_text()}")  # fmt: skip
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


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
    url = f"http://{address}:{port}"
    registry = Registry(f"{address}:{port}", url, Pusher(url, basic, pusher_headers),
                        tmp / "data", config)  # fmt: skip
    try:
        registry.start()
        yield registry
    finally:
        registry.pusher.close()
        registry.stop()

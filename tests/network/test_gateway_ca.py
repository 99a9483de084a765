"""A deployment's CA, given to every gateway (a Kubernetes Secret mounted read-only), is the one
it signs with; without it the gateway refuses to start rather than make one no guest trusts."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from space.gateway import GatewayProcess, GatewaySettings
from space.gateway.client import GatewayError
from space.pki import make_ca


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _gateway(tmp_path: Path, ca_dir: Path) -> GatewayProcess:
    return GatewayProcess(
        GatewaySettings(
            state_dir=tmp_path / "state",
            control_socket=tmp_path / "gateway.sock",
            upstream_dns="127.0.0.1:1",  # never asked: no sandbox is registered
            ca_dir=ca_dir,
            proxy_port=_free_port(),
            dns_port=_free_port(),
            user="nobody",
        )
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="the gateway starts as root")
async def test_gateway_signs_with_the_deployments_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ca.mkdir()
    make_ca(ca / "ca.pem", ca / "ca.key", "a deployment CA")
    for f in (ca / "ca.pem", ca / "ca.key", ca):
        f.chmod(0o500 if f.is_dir() else 0o400)  # as a secret volume mounts them
    gateway = _gateway(tmp_path, ca)
    client = await gateway.start()
    try:
        assert await client.ca_pem() == (ca / "ca.pem").read_bytes()
        assert not (tmp_path / "state" / "ca").exists()  # no CA of its own was made
    finally:
        await client.close()
        await gateway.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the gateway starts as root")
async def test_gateway_without_the_given_ca_does_not_start(tmp_path: Path) -> None:
    (tmp_path / "ca").mkdir()
    with pytest.raises(GatewayError, match="no CA"):
        await _gateway(tmp_path, tmp_path / "ca").start()
    assert not list((tmp_path / "ca").iterdir())

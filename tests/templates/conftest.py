"""A real OCI registry (Debian's docker-registry) on localhost, open and with htpasswd auth."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from tests.registry import Registry, serve_registry
from tests.templates.token_server import TokenService

USER, PASSWORD = "alice", "s3cret-pw"


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """An open registry."""
    yield from serve_registry(tmp_path_factory.mktemp("registry"))


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
    yield from serve_registry(tmp, auth, basic=(USER, PASSWORD))


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry with token auth: Bearer tokens from a token service that wants USER/PASSWORD."""
    tmp = tmp_path_factory.mktemp("token-registry")
    tokens = TokenService(tmp, USER, PASSWORD)
    push = {"Authorization": f"Bearer {tokens.token('repository:secret/app:pull,push')}"}
    try:
        yield from serve_registry(tmp, tokens.registry_auth(), push)
    finally:
        tokens.close()

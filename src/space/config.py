"""Deployment settings, from the environment with working defaults for one machine."""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from space import paths


def worker_secret() -> str:
    """The secret the API and controller present to workers (`SPACE_WORKER_SECRET`).

    Without one, a random secret is made once and kept in the state directory (mode 0600), so
    that every process of a one-machine deployment shares it.
    """
    return os.environ.get("SPACE_WORKER_SECRET") or _state_secret(
        "worker-secret", lambda: secrets.token_urlsafe(32)
    )


def sealing_keys() -> list[tuple[str, bytes]]:
    """The keys that encrypt secrets at rest, newest first: (key id, 32 bytes).

    `SPACE_SECRETS_KEYS` is "id:base64,id:base64,..." (a rotation puts a new key first; older
    ones stay until nothing is sealed with them). Without it a key is made once and kept in the
    state directory, like the worker secret."""
    text = os.environ.get("SPACE_SECRETS_KEYS") or _state_secret("secrets-keys", new_sealing_key)
    keys = []
    for item in text.replace("\n", ",").split(","):
        if item.strip():
            kid, _, b64 = item.strip().partition(":")
            key = base64.b64decode(b64)
            if not kid or len(key) != 32:
                raise ValueError("SPACE_SECRETS_KEYS: each key is id:base64 of 32 bytes")
            keys.append((kid, key))
    if not keys:
        raise ValueError("no key to seal secrets with")
    return keys


def new_sealing_key() -> str:
    return f"k{secrets.token_hex(4)}:{base64.b64encode(secrets.token_bytes(32)).decode()}"


def state_secret_path(name: str) -> Path:
    return paths.state_dir() / name


def _state_secret(name: str, make: Callable[[], str]) -> str:
    """A value made once and kept in the state directory (mode 0600), shared by every process
    of a one-machine deployment."""
    path = state_secret_path(name)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(make())
    try:
        os.link(tmp, path)  # atomic: of two processes racing here, exactly one value wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def api_address() -> tuple[str, int]:
    return os.environ.get("SPACE_API_HOST", "127.0.0.1"), int(
        os.environ.get("SPACE_API_PORT", "8080")
    )

"""Deployment settings, from the environment with working defaults for one machine."""

from __future__ import annotations

import os
import secrets

from space import paths


def worker_secret() -> str:
    """The secret the API and controller present to workers (`SPACE_WORKER_SECRET`).

    Without one, a random secret is made once and kept in the state directory (mode 0600), so
    that every process of a one-machine deployment shares it.
    """
    env = os.environ.get("SPACE_WORKER_SECRET")
    if env:
        return env
    path = paths.state_dir() / "worker-secret"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".worker-secret.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    try:
        os.link(tmp, path)  # atomic: of two processes racing here, exactly one secret wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text().strip()


def api_address() -> tuple[str, int]:
    return os.environ.get("SPACE_API_HOST", "127.0.0.1"), int(
        os.environ.get("SPACE_API_PORT", "8080")
    )

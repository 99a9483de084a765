from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from space.db.sealing import Sealer
from tests.db.conftest import database, store
from tests.webhooks.receiver import Receiver, receiving

__all__ = ["database", "store"]  # the database tests' real PostgreSQL, for these too


@pytest.fixture(scope="package")
def sealer() -> Sealer:
    return Sealer([("k1", os.urandom(32))])


@pytest.fixture(scope="package")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    with receiving(tmp_path_factory.mktemp("receiver")) as r:
        yield r

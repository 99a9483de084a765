"""Fixtures shared by every package: the whole platform (one per session, since it boots a real
stack of processes and VMs), used by the platform tests and the fault-injection suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .collector import Collector
from .stack import Platform, launch, shut_down


@pytest.fixture(scope="session")
def collector() -> Iterator[Collector]:
    c = Collector()
    c.start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[Platform]:
    """Its services send their spans to `collector`, as to an operator's."""
    p = launch(tmp_path_factory.mktemp("platform"), SPACE_OTLP_ENDPOINT=collector.url)
    try:
        yield p
    finally:
        shut_down(p)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the shared platform run last, in their order: the network tests before them
    make and remove their own worlds of namespaces, which would take the platform's with them."""
    on_platform = [i for i in items if "platform" in getattr(i, "fixturenames", ())]
    others = [i for i in items if "platform" not in getattr(i, "fixturenames", ())]
    items[:] = others + on_platform

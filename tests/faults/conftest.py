"""The fault-injection suite: faults injected for real (signals, kill -9 at named steps, the
database stopped, a full pool) into the whole platform, each test checking that nothing is lost
or leaked and that states converge within the bound it promises.

Each test records the bound it promises and what it measured; with SPACE_FAULT_REPORT=PATH the
session writes them there as JSON (the README's table is made from it with
`python -m tests.faults.report PATH`).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import pytest

from ..stack import Platform, Service

pytestmark = pytest.mark.vm


@dataclass
class Measure:
    fault: str
    promise: str
    bound_s: float
    measured_s: float


RESULTS: list[Measure] = []


def record(fault: str, promise: str, bound_s: float, measured_s: float) -> None:
    """Keep the figure, then hold the promise."""
    RESULTS.append(Measure(fault, promise, bound_s, round(measured_s, 2)))
    assert measured_s <= bound_s, f"{fault}: {promise} took {measured_s:.1f} s (bound {bound_s} s)"


def until(
    check: Callable[[], bool],
    timeout: float,
    step: float = 0.1,
    why: Callable[[], object] = lambda: "",
) -> float:
    """Seconds until `check()` holds; AssertionError (with `why()`) if not within `timeout`."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not reached within {timeout} s: {why()}")
        time.sleep(step)
    return time.monotonic() - started


def listening(svc: Service) -> bool:
    """The service (started with `--port`) accepts connections again."""
    port = int(svc.argv[svc.argv.index("--port") + 1])
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("SPACE_FAULT_REPORT")
    if path and RESULTS:
        with open(path, "w") as f:
            json.dump([asdict(m) for m in RESULTS], f, indent=2)


@contextmanager
def restarted(svc: Service, **env: str) -> Iterator[Service]:
    """The service running with `env` added (e.g. a crash point) for the block, then as
    before. Its VMs, if it is a worker, outlive both restarts."""
    saved = svc.env
    svc.stop()
    svc.env = {**saved, **env}
    svc.start()
    try:
        yield svc
    finally:
        svc.env = saved
        if svc.proc is not None and svc.proc.poll() is None:
            svc.stop()
        svc.start()


@pytest.fixture
def worker(platform: Platform) -> Service:
    """The platform's first worker, listening and shown active (an earlier test may have just
    restarted it)."""
    svc = platform.workers[platform.worker_id]
    until(lambda: listening(svc), 60)
    shown_active(platform, platform.worker_id)
    return svc


def shown_active(platform: Platform, worker_id: str) -> None:
    """Until the control plane shows the worker active (a restart slower than its heartbeat
    deadline shows it lost for a while, and creates are not placed on it meanwhile)."""

    def active() -> bool:
        items = admin.get("/v1/workers").json()["items"]
        return any(w["id"] == worker_id and w["state"] == "active" for w in items)

    with platform.client(platform.admin_key) as admin:
        until(active, 30)

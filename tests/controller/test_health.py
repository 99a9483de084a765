"""The leader's judgement of a silent worker (`controller.health`), with the clock, the store and
the workers' answers under the test's control: the promise is about time and order, which the
fault suite (tests/faults/test_hosts.py) shows end to end with a real SIGSTOP."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from space.controller import health as module
from space.controller.health import WorkerHealth
from space.worker.api.client import WorkerError

W = {"id": "w1", "url": "http://127.0.0.1:1", "state": "active"}
SANDBOX = {"id": "sb-1", "state": "running"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Store:
    def __init__(self) -> None:
        self.worker = dict(W)
        self.errors: list[str] = []

    async def workers(self) -> list[dict[str, Any]]:
        return [dict(self.worker)]

    async def on_worker(self, worker_id: str) -> list[dict[str, Any]]:
        return [dict(SANDBOX)] if not self.errors else []

    async def set_worker_state(self, worker_id: str, state: str) -> None:
        self.worker["state"] = state

    async def transition(self, sandbox_id: str, from_: list[str], to: str, **kw: Any) -> None:
        self.errors.append(kw["reason"])


class Silent:
    """A worker that does not answer: every probe times out."""

    async def health(self, w: Any) -> None:
        raise WorkerError(0, "no answer in 2 s", timed_out=True)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    # The module's own clock only: the event loop keeps the real one.
    monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=c))
    return c


async def test_a_stalled_leader_does_not_call_its_workers_lost_at_once(clock: Clock) -> None:
    store = Store()
    health = WorkerHealth(store, Silent(), None, lost_after_s=3.0, epoch=lambda: 1,  # type: ignore[arg-type]
                          egress_default="deny")  # fmt: skip
    clock.now += 10  # the leader itself stood still for 10 s: its first probe since fails
    await health.once()
    assert store.worker["state"] == "active" and not store.errors
    clock.now += 1  # a second probe in a row goes unanswered: now it is silence
    await health.once()
    assert store.worker["state"] == "lost"
    assert store.errors and "worker w1 lost: no answer for 11 s" in store.errors[0]


async def test_two_quick_misses_are_not_silence_either(clock: Clock) -> None:
    store = Store()
    health = WorkerHealth(store, Silent(), None, lost_after_s=3.0, epoch=lambda: 1,  # type: ignore[arg-type]
                          egress_default="deny")  # fmt: skip
    for _ in range(2):  # two misses within the bound
        clock.now += 1
        await health.once()
    assert store.worker["state"] == "active" and not store.errors
    clock.now += 1.5
    await health.once()
    assert store.worker["state"] == "lost"

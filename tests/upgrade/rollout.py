"""What a rolling upgrade needs beside the platform: the previous release's code, taken from
this repository at the commit CHANGELOG.md names, and a client that keeps working while the
services are replaced under it, noting every error and how long each of its rounds waited.

Shared by tests/upgrade and bench/rolling_upgrade.py."""

from __future__ import annotations

import re
import secrets
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from space import release

from ..platform.helpers import run
from ..stack import SPACE, Platform, Service, release_env

REPO = Path(__file__).resolve().parents[2]
_HEADING = re.compile(r"^## (\d+\.\d+\.\d+) — commit ([0-9a-f]{7,40})$", re.MULTILINE)
# A client's connect attempts while the API it talks to is replaced: httpx waits 0.5, 1, 2, 4…
# seconds between them, so 6 cover a restart of 15 s.
CONNECT_RETRIES = 6
REPEATS = 3  # sends of a request that is safe to repeat, when its connection broke


def previous_release() -> tuple[str, str]:
    """(version, commit) of the newest release of the previous minor version, as CHANGELOG.md
    names it: the oldest a rolling upgrade to this checkout starts from, and where a rollback
    goes back to."""
    major, minor, _ = release.parse(release.VERSION)
    found = _HEADING.findall((REPO / "CHANGELOG.md").read_text())
    older = [(v, c) for v, c in found if release.parse(v)[:2] == (major, minor - 1)]
    if not older:
        raise LookupError(f"CHANGELOG.md names no release {major}.{minor - 1}")
    return max(older, key=lambda vc: release.parse(vc[0]))


def check_out(commit: str, dest: Path) -> Path:
    """The `src` directory of `commit`, written under `dest` (a worktree of it without git's
    bookkeeping: nothing is left in the repository)."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "src"],
        capture_output=True, check=False, timeout=120,
    )  # fmt: skip
    if archive.returncode != 0:
        raise LookupError(
            f"commit {commit} is not in this clone ({archive.stderr.decode().strip()}): the "
            "upgrade tests need the repository's history"
        )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=120)
    return dest / "src"


@dataclass
class Round:
    step: str  # what was being replaced while it ran
    started: float
    create_s: float = 0.0
    exec_s: float = 0.0
    delete_s: float = 0.0
    error: str = ""


@dataclass
class Traffic:
    """An agent's loop, on a thread: create a sandbox, run a command in it, delete it, again.
    Its connections are kept alive between requests, as the SDKs' are, and a connect that is
    refused is tried again (what a client behind a load balancer sees of one API replica going
    away)."""

    api_url: str
    key: str
    step: str = "before"
    rounds: list[Round] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(300)

    def errors(self) -> list[str]:
        return [f"{r.step}: {r.error}" for r in self.rounds if r.error]

    def done_in(self, step: str) -> int:
        return sum(1 for r in self.rounds if r.step == step and not r.error)

    def wait_rounds(self, step: str, count: int, timeout: float = 240) -> None:
        """Until `count` rounds begun during `step` have ended well."""
        deadline = time.monotonic() + timeout
        while self.done_in(step) < count:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the client did not get {count} rounds through during {step} in "
                    f"{timeout} s: {self.errors()[-5:]}"
                )
            time.sleep(0.2)

    def _run(self) -> None:
        transport = httpx.HTTPTransport(retries=CONNECT_RETRIES)
        with httpx.Client(
            base_url=self.api_url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120,
            transport=transport,
        ) as c:  # fmt: skip
            while not self._stop.is_set():
                r = Round(self.step, time.monotonic())
                try:
                    self._round(c, r)
                except (httpx.HTTPError, AssertionError, ValueError, KeyError) as e:
                    r.error = f"{type(e).__name__}: {e}"[:500]
                    time.sleep(0.5)  # as a client would, rather than spin on an error
                self.rounds.append(r)

    def _round(self, c: httpx.Client, r: Round) -> None:
        t = time.monotonic()
        key = secrets.token_hex(8)
        made = _again(lambda: c.post("/v1/sandboxes", json={}, headers={"Idempotency-Key": key}),
                      "create")  # fmt: skip
        assert made.status_code == 201, f"create: {made.status_code} {made.text[:300]}"
        sandbox_id = made.json()["id"]
        r.create_s, t = time.monotonic() - t, time.monotonic()
        try:
            out, err, code = run(c, sandbox_id, "echo ok")
        except httpx.TransportError as e:
            raise AssertionError(f"exec: {type(e).__name__}: {e}") from e
        assert (out, code) == (b"ok\n", 0), f"exec: {out!r} {err!r} {code}"
        r.exec_s, t = time.monotonic() - t, time.monotonic()
        gone = _again(lambda: c.delete(f"/v1/sandboxes/{sandbox_id}"), "delete")
        assert gone.status_code in (200, 202, 204), f"delete: {gone.status_code} {gone.text}"
        r.delete_s = time.monotonic() - t


def _again(call: Callable[[], httpx.Response], what: str) -> httpx.Response:
    """A request that is safe to repeat (a create with its idempotency key, a delete), sent
    again when its connection broke before an answer: an API replica that stops closes the
    connections it accepted and had not read yet."""
    for _ in range(REPEATS - 1):
        try:
            return call()
        except httpx.TransportError:
            time.sleep(0.5)
    try:
        return call()
    except httpx.TransportError as e:
        raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e


def replace(
    p: Platform, traffic: Traffic, step: str, svc: Service, code: Path | None, rounds: int = 2
) -> None:
    """`svc` stopped and started again from the release whose package is in `code` (None: this
    checkout's), while the client works on; done once `rounds` of the client's went through."""
    traffic.step = step
    svc.env = release_env(svc.env, code)
    svc.restart()
    if svc is p.api:
        p.wait_api()
    traffic.wait_rounds(step, rounds)


def migrate(p: Platform, traffic: Traffic, rounds: int = 2) -> None:
    """This checkout's migrations, as a rollout runs them first (`space admin migrate`)."""
    traffic.step = "schema"
    done = subprocess.run([*SPACE, "admin", "migrate"], env=release_env(p.env, None),
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    traffic.wait_rounds("schema", rounds)


def summary(rounds: list[Round]) -> dict[str, dict[str, Any]]:
    """Per step (in order): rounds, errors, create's p50 and p99 and the slowest round, in
    seconds."""
    steps: dict[str, list[Round]] = {}
    for r in rounds:
        steps.setdefault(r.step, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for step, rs in steps.items():
        creates = sorted(r.create_s for r in rs if not r.error)
        out[step] = {
            "rounds": len(rs),
            "errors": sum(1 for r in rs if r.error),
            "create_p50_s": round(statistics.median(creates), 3) if creates else None,
            "create_p99_s": round(creates[min(len(creates) - 1, int(len(creates) * 0.99))], 3)
            if creates
            else None,
            "slowest_round_s": round(max(r.create_s + r.exec_s + r.delete_s for r in rs), 3),
        }
    return out

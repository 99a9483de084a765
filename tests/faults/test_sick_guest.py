"""A guest that misbehaves from the inside never takes its sandbox's controls away: with a fork
bomb, memory exhausted, every vCPU spinning, a full root disk, its inodes exhausted or a
process that closed its stdout, `exec true`, a file read and a PTY still answer within 5 s,
and suspend, resume and delete still work. What the tenant started keeps running where the
kernel lets it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import space

from ..stack import Platform
from .conftest import record

pytestmark = pytest.mark.vm

ANSWER_S = 5.0

SICKNESS = {
    "fork bomb": "b(){ b | b & }; b",
    "memory exhausted": "python3 -c 'l = []\nwhile True: l.append(bytearray(16 << 20))'",
    "every vCPU spinning": "for i in $(seq $(nproc)); do (while :; do :; done) & done; wait",
    "root disk full": "dd if=/dev/zero of=/root/fill bs=1M; sleep 600",
    "inodes exhausted": "mkdir /root/i && cd /root/i && i=0; while touch f$i; do i=$((i+1)); done;"
    " sleep 600",
    "stdout closed": "exec >&-; exec 2>&-; sleep 600",
}


def _timed(what: str, sickness: str, call: Callable[[], object], times: int = 1) -> None:
    """The slowest of `times` calls, against the bound."""
    took = []
    for _ in range(times):
        started = time.monotonic()
        call()
        took.append(time.monotonic() - started)
    record(f"{what} with {sickness}", "answers", ANSWER_S, max(took))


@pytest.mark.parametrize("sickness", list(SICKNESS))
def test_the_controls_answer_whatever_the_guest_does(platform: Platform, sickness: str) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        sb.files.write("/root/kept", b"kept")
        sb.processes.start(SICKNESS[sickness], tag="sick")
        time.sleep(5)  # it has taken what it can
        _timed("exec true", sickness, lambda: sb.exec("true"), times=3)
        _timed("file read", sickness, lambda: sb.files.read("/root/kept"), times=3)

        def pty_answers() -> None:
            term = sb.pty.create(rows=24, cols=80)
            with term.output() as screen:
                term.write("echo pty-$((40+2))\n")
                seen = b""
                for _, data in screen:
                    seen += data
                    if b"pty-42" in seen:
                        break
            term.kill()

        _timed("a PTY", sickness, pty_answers)
        started = time.monotonic()
        sb.suspend()
        sb.resume()
        record(f"suspend and resume with {sickness}", "done", 30.0, time.monotonic() - started)
        assert sb.files.read("/root/kept") == b"kept"
        assert any(p.tag == "sick" for p in sb.processes.list()) or sickness == "memory exhausted"
        started = time.monotonic()
    record(f"delete with {sickness}", "done", 15.0, time.monotonic() - started)

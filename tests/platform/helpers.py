"""Small helpers over the raw HTTP API, shared by the platform tests."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import httpx


def create(c: httpx.Client, **body: Any) -> dict[str, Any]:
    r = c.post("/v1/sandboxes", json=body)
    assert r.status_code in (200, 201, 202), r.text
    return dict(r.json())


def exec_events(c: httpx.Client, sandbox_id: str, **body: Any) -> list[dict[str, Any]]:
    with c.stream("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body) as r:
        assert r.status_code == 200, r.read().decode()
        return [json.loads(line) for line in r.iter_lines() if line]


def run(c: httpx.Client, sandbox_id: str, cmd: str, **body: Any) -> tuple[bytes, bytes, int]:
    """stdout, stderr and the exit code of `cmd`."""
    events = exec_events(c, sandbox_id, cmd=cmd, **body)
    out = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout")
    err = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stderr")
    exits = [e for e in events if e["type"] == "exit"]
    assert exits, events
    return out, err, exits[0]["exit_code"]


def wait_state(
    c: httpx.Client, sandbox_id: str, want: str, timeout: float = 60, reason: str | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    sb: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            sb = c.get(f"/v1/sandboxes/{sandbox_id}").json()
        except httpx.TransportError:
            sb = {}
        if sb.get("state") == want and (reason is None or reason in (sb.get("reason") or "")):
            return sb
        time.sleep(0.2)
    raise AssertionError(f"{sandbox_id} did not reach {want} in {timeout}s: {sb}")


COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    ">/dev/null 2>&1 & echo $!"
)


def start_counter(c: httpx.Client, sandbox_id: str) -> int:
    out, _, code = run(c, sandbox_id, COUNTER)
    assert code == 0
    return int(out)


def counter_runs(c: httpx.Client, sandbox_id: str, pid: int) -> bool:
    """The process is alive and its counter moves."""
    _, _, alive = run(c, sandbox_id, f"kill -0 {pid}")
    if alive != 0:
        return False
    first = run(c, sandbox_id, "cat /tmp/counter")[0]
    for _ in range(30):
        time.sleep(0.2)
        if run(c, sandbox_id, "cat /tmp/counter")[0] != first:
            return True
    return False

"""Small helpers over the raw HTTP API, shared by the platform tests."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx

from space.db.store import Store, connect


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
    return _outcome(exec_events(c, sandbox_id, cmd=cmd, **body))


def out(c: httpx.Client, sandbox_id: str, cmd: str) -> str:
    """The stdout of `cmd`, which must succeed."""
    stdout, stderr, code = run(c, sandbox_id, cmd)
    assert code == 0, (cmd, stderr)
    return stdout.decode()


def run_argv(
    c: httpx.Client, sandbox_id: str, argv: list[str], **body: Any
) -> tuple[bytes, bytes, int]:
    """stdout, stderr and the exit code of `argv`, run with no shell."""
    return _outcome(exec_events(c, sandbox_id, argv=argv, **body))


def _outcome(events: list[dict[str, Any]]) -> tuple[bytes, bytes, int]:
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
    """The process is alive and its counter moves within 15 s (a TCG guest beside busy ones
    may be starved for seconds). What the guest shows is printed when it does not."""
    _, _, alive = run(c, sandbox_id, f"kill -0 {pid}")
    first = run(c, sandbox_id, "cat /tmp/counter")[0]
    deadline = time.monotonic() + 15
    while alive == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        if run(c, sandbox_id, "cat /tmp/counter")[0] != first:
            return True
    try:
        shown: object = run(c, sandbox_id, "date; uptime; ps -eo pid,stat,etime,comm | tail -30")
    except (httpx.HTTPError, AssertionError) as e:
        shown = e
    print(f"{sandbox_id}: counter {pid} alive={alive == 0} stuck at {first!r}: {shown}")
    return False


FETCH = """
import sys, urllib.request as u
req = u.Request(sys.argv[1], headers=dict(h.split(":", 1) for h in sys.argv[2:]))
try:
    print(u.urlopen(req, timeout=20).read().decode())
except Exception as e:
    print(f"refused: {e}")
    sys.exit(3)
"""


def fetch(c: httpx.Client, sandbox_id: str, url: str, *headers: str) -> tuple[int, str]:
    """Exit code and output of an HTTP(S) request made with Python inside the sandbox."""
    events = exec_events(c, sandbox_id, argv=["python3", "-c", FETCH, url, *headers])
    out = b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout")
    return next(e["exit_code"] for e in events if e["type"] == "exit"), out.decode().strip()


def peak_rss_mib(pid: int) -> float:
    """The most memory the process has held (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def key_with_quotas(database_url: str, prefix: str, quotas: dict[str, int]) -> str:
    """An API key of a new tenant with these quota overrides."""

    async def make() -> str:
        store = Store(connect(database_url, pool_size=1))
        try:
            tenant = await store.create_tenant(f"{prefix}-{secrets.token_hex(4)}")
            await store.set_quotas(tenant.id, quotas)
            return await store.create_api_key(tenant.id)
        finally:
            await store.close()

    return asyncio.run(make())

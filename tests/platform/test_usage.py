"""Metering against the host's own accounting: a real sandbox burns CPU, sends and fetches
through its gateway and writes to its disk; what `GET /v1/usage` then says agrees within 5 %
with the kernel's CPU accounting of its VMM's cgroup, the bytes the origin took and gave, the
wall clock it ran by and its disk's blocks on the pool. The same figures reach the tenant, the
Prometheus counters and `space usage`; another tenant sees none of them."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..cli.runner import space
from ..stack import Platform
from ..vm.conftest import vmm_pids
from .helpers import create, run

POOL = Path("/var/lib/space/pool")
SENT, FETCHED = 3_000_000, 4_000_000
WORK = (
    "python3 -c 'import time; t = time.time()\n"
    "while time.time() - t < 5: pass' && "
    "python3 -c 'import urllib.request as u\n"
    f'u.urlopen(u.Request("http://allowed.test/", data=b"u" * {SENT}), timeout=60).read()\n'
    f'assert len(u.urlopen("http://allowed.test/bytes/{FETCHED}", timeout=60).read()) == '
    f"{FETCHED}' && "
    "head -c 33554432 /dev/urandom > /root/blob && sync"
)


def cpu_accounted(pid: int) -> float:
    """The CPU time the kernel accounted to the VMM's own cgroup (all its threads, ever)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            root = next(p for p in Path("/sys/fs/cgroup").iterdir()
                        if "cpuacct" in p.name.split(","))  # fmt: skip
            return int((root / path.lstrip("/") / "cpuacct.usage").read_text()) / 1e9
        if controllers == "" and path.startswith("/space/"):
            stat = (Path("/sys/fs/cgroup") / path.lstrip("/") / "cpu.stat").read_text()
            return int(stat.split("usage_usec")[1].split()[0]) / 1e6
    raise AssertionError(f"no CPU accounting for {pid}")


def usage(c: httpx.Client, **params: str) -> dict[str, Any]:
    r = c.get("/v1/usage", params=params)
    assert r.status_code == 200, r.text
    return dict(r.json())


def within(measured: float, truth: float, share: float = 0.05) -> bool:
    return abs(measured - truth) <= share * truth


def test_usage_agrees_with_the_hosts_own_accounting(platform: Platform) -> None:
    with platform.client() as c, platform.client(platform.admin_key) as admin:
        start = datetime.now(UTC) - timedelta(minutes=1)
        # A shape no warm pool keeps: its VMM starts now, metered from its start.
        sb = create(c, vcpus=2, memory_mib=448, network={"hosts": [{"pattern": "allowed.test"}]})
        made = time.monotonic()
        sid = sb["id"]
        [pid] = vmm_pids(POOL / "workers" / sb["worker_id"] / "vms" / sid)
        _, err, code = run(c, sid, WORK)
        assert code == 0, err.decode()
        time.sleep(max(0.0, 25 - (time.monotonic() - made)))  # a run long enough to time
        assert c.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        ran = time.monotonic() - made
        disk = next(POOL.glob(f"workers/*/vms/{sid}/disk*")).stat().st_blocks * 512

        # Its paused VMM stands still: once metering has read it twice more, nothing moves.
        params = {"sandbox": sid, "since": start.isoformat(), "step": "1d"}
        deadline = time.monotonic() + 30
        while True:
            mine = usage(admin, **params)["total"]  # the admin's: a pool member's part too
            if mine["paused_seconds"] >= 3:
                break
            assert time.monotonic() < deadline, mine
            time.sleep(0.5)
        accounted = cpu_accounted(pid)

        assert within(mine["cpu_seconds"], accounted), (mine["cpu_seconds"], accounted)
        assert mine["cpu_seconds"] > 5  # the burn, at least
        assert within(mine["running_seconds"], ran), (mine["running_seconds"], ran)
        assert mine["vcpu_seconds_running"] == pytest.approx(2 * mine["running_seconds"])
        assert mine["memory_gib_seconds_running"] == pytest.approx(
            448 / 1024 * mine["running_seconds"])  # fmt: skip
        assert mine["vcpu_seconds_paused"] > 0 and mine["suspended_seconds"] == 0
        # The origin's own count of what it took and gave.
        took = [len(str(e["body"])) for e in platform.internet.internet_events()
                if e.get("method") == "POST" and e.get("path") == "/"]  # fmt: skip
        assert SENT in took
        assert within(mine["egress_bytes"], SENT), mine["egress_bytes"]
        assert within(mine["ingress_bytes"], FETCHED), mine["ingress_bytes"]
        assert mine["net_tx_bytes"] >= mine["egress_bytes"]  # its NIC: the gateway's and TCP's
        # Its disk's blocks on the pool, by the hour it was paused.
        points = usage(admin, sandbox=sid, since=start.isoformat(), step="1s")["series"][0]
        paused = [p for p in points["points"] if p["paused_seconds"] > 0.5]
        assert paused, points
        for p in paused:
            # Held while running too: a second that ran before the pause holds it as long.
            held_s = p["paused_seconds"] + p["running_seconds"]
            gib = p["disk_gib_hours"] * 3600 / held_s * (1 << 30)
            assert within(gib, disk), (gib, disk)

        # By host, as the tenant sees it; never another tenant's.
        hosts = c.get("/v1/usage/hosts", params={"sandbox": sid, "since": start.isoformat()})
        assert hosts.status_code == 200, hosts.text
        [host] = hosts.json()["items"]
        assert host["host"] == "allowed.test" and within(host["sent_bytes"], SENT)
        own = usage(c, by="sandbox", since=start.isoformat(), step="1d")
        assert sid in {s["key"] for s in own["series"]}
        with platform.client(platform.key_b) as b:
            theirs = usage(b, sandbox=sid, since=start.isoformat())
            assert theirs["series"] == [] and theirs["total"]["cpu_seconds"] == 0
            assert b.get("/v1/usage", params={"tenant": "anyone"}).status_code == 403
            assert b.get("/v1/usage", params={"by": "tenant"}).status_code == 403

        # The tenant's counters for Prometheus, and `space usage`.
        r = httpx.get(f"{platform.api_url}/metrics",
                      headers={"Authorization": f"Bearer {platform.metrics_token}"})  # fmt: skip
        tenant = c.get("/v1/me").json()["tenant_id"]
        counters = {
            (s.name, s.labels["state"]): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples
            if f.name.startswith("space_usage_") and s.labels.get("tenant") == tenant
        }  # fmt: skip
        assert counters[("space_usage_cpu_seconds_total", "running")] >= mine["cpu_seconds"] / 2
        assert counters[("space_usage_egress_bytes_total", "running")] >= SENT
        env = {"SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
        out = space("usage", "--sandbox", sid, "--since", "10m", "--json", env=env).stdout
        assert json.loads(out)["total"]["egress_bytes"] >= mine["egress_bytes"]
        table = space("usage", "--by", "sandbox", "--since", "10m", env=env).stdout
        assert sid in table and "vCPU-h run" in table
        assert c.delete(f"/v1/sandboxes/{sid}").status_code in (200, 202, 204)


def test_bad_usage_questions_are_told_what_is_wrong(platform: Platform) -> None:
    with platform.client() as c:
        for bad, why in (
            ({"step": "0"}, "step"),
            ({"step": "1w"}, "step"),
            ({"step": "1s", "since": "2020-01-01T00:00:00Z"}, "steps"),
            ({"by": "color"}, "by"),
            ({"label": "no-equals"}, "KEY=VALUE"),
            ({"since": "2026-01-02T00:00:00Z", "until": "2026-01-01T00:00:00Z"}, "before"),
            ({"since": "2026-01-01T00:00:00"}, "time zone"),
        ):
            r = c.get("/v1/usage", params=bad)
            assert r.status_code == 400 and why in r.json()["detail"], (bad, r.text)
        r = c.get("/v1/usage", params={"since": "yesterday"})
        assert r.status_code == 422 and "Traceback" not in r.text

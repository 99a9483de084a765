"""Per-sandbox figures measured on the host: a real sandbox burns CPU, touches memory, writes a
file and fetches through its gateway, and its CPU time, memory, disk and network bytes move in
`GET /v1/sandboxes/{id}/stats` and in its worker's /metrics."""

from __future__ import annotations

import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..stack import Platform
from .helpers import create, fetch, run

FIGURES = ("cpu_seconds", "memory_bytes", "disk_bytes", "net_rx_bytes", "net_tx_bytes")
WORK = (
    # CPU for a second or so of guest time, 64 MiB of memory touched page by page, and 24 MiB
    # of new file data on the root disk.
    "python3 -c 'import time; t = time.time()\n"
    "while time.time() - t < 1.5: pass\n"
    "b = bytearray(64 << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1' && "
    "head -c 25165824 /dev/urandom > /root/blob && sync"
)


def stats(c: httpx.Client, sandbox_id: str) -> dict[str, Any]:
    r = c.get(f"/v1/sandboxes/{sandbox_id}/stats")
    assert r.status_code == 200, r.text
    return dict(r.json())


def scrape(platform: Platform, sb: dict[str, Any]) -> dict[str, float]:
    """Its figures in the metrics of the worker it runs on (an earlier test may have added one)."""
    sandbox_id = sb["id"]
    url = platform.worker_metrics[sb["worker_id"]]
    assert httpx.get(url, timeout=30).status_code == 401  # the token is needed
    r = httpx.get(url, headers={"Authorization": f"Bearer {platform.metrics_token}"}, timeout=30)
    assert r.status_code == 200, r.text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
        if sample.labels.get("sandbox") == sandbox_id
    }


def scrape_live(platform: Platform, sb: dict[str, Any]) -> dict[str, float]:
    """Its figures from a scrape that measured it: one that found its VMM busy past the
    deadline of its status leaves it out, as it leaves out one that went away."""
    deadline = time.monotonic() + 30
    while "space_sandbox_cpu_seconds_total" not in (scraped := scrape(platform, sb)):
        assert time.monotonic() < deadline, f"no scrape measured {sb['id']}: {scraped}"
        time.sleep(1)
    return scraped


def test_figures_move_with_what_the_sandbox_does(platform: Platform) -> None:
    with platform.client() as c:
        sb = create(c, network={"hosts": [{"pattern": "allowed.test"}]})
        sid = sb["id"]
        before = stats(c, sid)
        assert before["id"] == sid and before["state"] == "running"
        assert before["vcpus"] == sb["vcpus"] and before["memory_mib"] == sb["memory_mib"]
        assert all(isinstance(before[k], int | float) for k in FIGURES), before
        scraped_before = scrape_live(platform, sb)

        _, err, code = run(c, sid, WORK)
        assert code == 0, err
        code, out = fetch(c, sid, "http://allowed.test/")
        assert code == 0 and out.startswith("hello from allowed.test"), out

        after = stats(c, sid)
        assert after["at"] > before["at"]
        assert after["cpu_seconds"] >= before["cpu_seconds"] + 1.0, (before, after)
        assert after["memory_bytes"] >= before["memory_bytes"] + (32 << 20), (before, after)
        assert after["disk_bytes"] >= before["disk_bytes"] + (16 << 20), (before, after)
        # The reply of the origin came in; the request went out.
        assert after["net_rx_bytes"] > before["net_rx_bytes"] + 100, (before, after)
        assert after["net_tx_bytes"] > before["net_tx_bytes"] + 100, (before, after)

        scraped = scrape_live(platform, sb)
        assert scraped["space_sandbox_cpu_seconds_total"] >= after["cpu_seconds"]
        assert scraped["space_sandbox_cpu_seconds_total"] > (
            scraped_before["space_sandbox_cpu_seconds_total"] + 1.0
        )
        assert scraped["space_sandbox_memory_bytes"] > 0
        assert scraped["space_sandbox_disk_bytes"] >= after["disk_bytes"]
        assert scraped["space_sandbox_network_receive_bytes_total"] >= after["net_rx_bytes"]
        assert scraped["space_sandbox_network_transmit_bytes_total"] >= after["net_tx_bytes"]

        # Only the tenant's own sandboxes, and only running ones.
        with platform.client(platform.key_b) as other:
            r = other.get(f"/v1/sandboxes/{sid}/stats")
            assert r.status_code == 404, r.text
        assert c.get("/v1/sandboxes/sb-none/stats").status_code == 404
        assert c.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
        r = c.get(f"/v1/sandboxes/{sid}/stats")
        assert r.status_code == 409 and r.json()["state"] == "paused", r.text
        assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"
        deadline = time.monotonic() + 30
        while sid in str(scrape(platform, sb)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert scrape(platform, sb) == {}  # a deleted sandbox leaves the metrics

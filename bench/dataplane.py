"""The data plane through the API against what lies beneath it, in one run:

  - upload through the API (`PUT /files`)  vs  download of the same file through the API; and
    both straight to the agent of a VM on the same host (`write_file`, `iter_file`)
  - stdout through the API (NDJSON exec of `head -c N /dev/zero`)  vs  the agent's own in a VM
  - exec `true` through the API  vs  straight to the agent
  - ingress: a large answer of a service in the sandbox through the API  vs  a client in the
    guest reaching the same service; whether the service's Content-Length was kept

Throughputs are the median of `--rounds` rounds. Starts its own embedded PostgreSQL, API,
controller and worker, and boots one more VM for the baselines. Run as root:
  .venv/bin/python bench/dataplane.py [--mib 64] [--ingress-mib 128] [--rounds 3] [--execs 100]
      [--json bench/results/dataplane.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from services import platform
from space.db.store import Store
from space.worker.local import local_runtime
from space.worker.machine import Machine
from vm_runtime import percentile_table, percentiles

PORT = 8000  # the service in the sandbox
SERVE = f"cd /tmp && exec python3 -m http.server {PORT} --bind 127.0.0.1"
# The same service read by a client inside the guest: bytes per second.
IN_GUEST_GET = (
    "import time, urllib.request\n"
    "t = time.perf_counter()\n"
    f"r = urllib.request.urlopen('http://127.0.0.1:{PORT}/big')\n"
    "n = 0\n"
    "while b := r.read(1 << 20):\n"
    "    n += len(b)\n"
    "print(n / (time.perf_counter() - t))\n"
)


async def setup(store: Store) -> dict[str, str]:
    tenant = await store.create_tenant(f"bench-dataplane-{secrets.token_hex(3)}")
    return {"key": await store.create_api_key(tenant.id)}


def mb_s(size: int, fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return size / (time.perf_counter() - t) / 1e6


def run(c: httpx.Client, sid: str, cmd: str | list[str]) -> tuple[bytes, int | None]:
    """A command (a shell's, or an argv) through the API's NDJSON exec: its stdout and exit
    code."""
    out = bytearray()
    code = None
    body = {"cmd": cmd} if isinstance(cmd, str) else {"argv": cmd}
    with c.stream("POST", f"/v1/sandboxes/{sid}/exec", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            event = json.loads(line)
            if event["type"] == "stdout":
                out += base64.b64decode(event["data"])
            elif event["type"] == "exit":
                code = event["exit_code"]
    return bytes(out), code


def through_api(url: str, key: str, args: argparse.Namespace) -> dict[str, Any]:
    size, big = args.mib << 20, args.ingress_mib << 20
    data = os.urandom(size)
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
    sid = c.post("/v1/sandboxes", json={"memory_mib": 512, "disk_mib": 2048}).json()["id"]
    files = f"/v1/sandboxes/{sid}/files"

    def upload() -> None:
        c.put(files, params={"path": "/root/blob"}, content=data).raise_for_status()

    def download() -> None:
        got = 0
        with c.stream("GET", files, params={"path": "/root/blob"}) as r:
            for chunk in r.iter_raw():
                got += len(chunk)
        assert got == size, got

    def stdout() -> None:
        out, code = run(c, sid, f"head -c {size} /dev/zero")
        assert code == 0 and len(out) == size

    up = [mb_s(size, upload) for _ in range(args.rounds)]
    down = [mb_s(size, download) for _ in range(args.rounds)]
    out = [mb_s(size, stdout) for _ in range(args.rounds)]
    execs = []
    for _ in range(args.execs):
        t = time.perf_counter()
        run(c, sid, "true")
        execs.append(time.perf_counter() - t)

    # Ingress: the service's answer through the API, and read inside the guest.
    assert run(c, sid, f"head -c {big} /dev/zero > /tmp/big && ({SERVE}) >/dev/null 2>&1 &")[1] == 0
    ingress_url = f"/v1/sandboxes/{sid}/ports/{PORT}/big"
    while c.get(f"/v1/sandboxes/{sid}/ports/{PORT}/").status_code != 200:
        time.sleep(0.2)
    lengths = []

    def ingress() -> None:
        got = 0
        with c.stream("GET", ingress_url) as r:
            lengths.append(r.headers.get("content-length"))
            for chunk in r.iter_raw():
                got += len(chunk)
        assert got == big, got

    def in_guest() -> float:
        out, code = run(c, sid, ["python3", "-c", IN_GUEST_GET])
        assert code == 0, out
        return float(out) / 1e6

    through = [mb_s(big, ingress) for _ in range(args.rounds)]
    guest = [in_guest() for _ in range(args.rounds)]
    c.delete(f"/v1/sandboxes/{sid}")
    c.close()
    return {
        "api_upload_mb_s": statistics.median(up),
        "api_download_mb_s": statistics.median(down),
        "api_stdout_mb_s": statistics.median(out),
        "api_exec_true": percentiles(execs),
        "ingress_mb_s": statistics.median(through),
        "in_guest_client_mb_s": statistics.median(guest),
        "ingress_content_length_kept": all(n == str(big) for n in lengths),
    }


async def straight_to_the_agent(args: argparse.Namespace) -> dict[str, Any]:
    size = args.mib << 20
    data = os.urandom(size)
    rt = await local_runtime()
    async with await Machine.boot(rt.driver, rt.pool, rt.images, memory_mib=512) as m:
        agent = m.agent
        up, down, out, execs = [], [], [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            await agent.write_file("/root/blob", data)
            up.append(size / (time.perf_counter() - t) / 1e6)
            t = time.perf_counter()
            got = 0
            async for chunk in agent.iter_file("/root/blob"):
                got += len(chunk)
            assert got == size
            down.append(size / (time.perf_counter() - t) / 1e6)
            t = time.perf_counter()
            r = await agent.run(f"head -c {size} /dev/zero", timeout=600, max_output=size)
            assert len(r.stdout) == size
            out.append(size / (time.perf_counter() - t) / 1e6)
        for _ in range(args.execs):
            t = time.perf_counter()
            await agent.run(["true"])
            execs.append(time.perf_counter() - t)
    return {
        "agent_write_mb_s": statistics.median(up),
        "agent_read_mb_s": statistics.median(down),
        "agent_stdout_mb_s": statistics.median(out),
        "agent_exec_true": percentiles(execs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--ingress-mib", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with platform(setup) as (p, keys):
        p.wait_worker(keys["key"])
        results = through_api(p.url, keys["key"], args)
    results.update(asyncio.run(straight_to_the_agent(args)))
    r = results
    ratios = {
        "upload / download, through the API": r["api_upload_mb_s"] / r["api_download_mb_s"],
        "upload through the API / straight to the agent": r["api_upload_mb_s"]
        / r["agent_write_mb_s"],
        "stdout through the API / the agent's own": r["api_stdout_mb_s"] / r["agent_stdout_mb_s"],
        "exec p50 through the API / straight to the agent": r["api_exec_true"]["p50_ms"]
        / r["agent_exec_true"]["p50_ms"],
        "ingress / a client in the guest": r["ingress_mb_s"] / r["in_guest_client_mb_s"],
    }
    results["ratios"] = ratios
    print("\n".join(percentile_table(results)))
    for key, value in results.items():
        if key.endswith("_mb_s"):
            print(f"{key:<40} {value:8.1f} MB/s")
    print(f"{'ingress_content_length_kept':<40} {results['ingress_content_length_kept']}")
    for name, ratio in ratios.items():
        print(f"{name:<55} {ratio:6.2f}x")
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

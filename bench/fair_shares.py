"""Fair-shares benchmark: what one sandbox flooding its disk or its network costs another.

Disk (two real microVMs on one pool): a quiet guest times 4 KiB random reads (O_DIRECT) and
4 KiB writes each followed by fsync, first while its neighbour idles (the baseline, in the same
run), then while the neighbour writes and reads its own disk as fast as it can (direct I/O,
1 MiB at a time, in a loop).
Network (namespaces standing in for guests, a real gateway: tests/network/world.py): a quiet
guest downloads through the gateway alone, then while a noisy guest downloads on `--streams`
connections at once.
Each is run with the worker's default shares and with none (SPACE_WORKER_DISK_MIB_S=0 …), so
the table shows what the shares buy. Run as root:
  .venv/bin/python bench/fair_shares.py [--samples 300] [--mb 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.network

from tests.network.world import NET_CONFIG, World

from space.gateway import HostRule, Policy
from space.settings import Shares
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import Machine
from space.worker.network import NetworkManager
from vm_runtime import percentile_table, percentiles

DEFAULT = Shares()
NONE = Shares(disk_mib_s=0, disk_iops=0, net_mbit=0)
PROBE = """
import json, mmap, os, random, sys, time
n = int(sys.argv[1])
path, size = "/root/probe", 64 << 20
if not os.path.exists(path):
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
        os.fsync(f.fileno())
buf = mmap.mmap(-1, 4096)
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
reads = []
for _ in range(n):
    t = time.perf_counter()
    os.preadv(fd, [buf], random.randrange(size >> 12) << 12)
    reads.append(time.perf_counter() - t)
os.close(fd)
fd = os.open("/root/probe-w", os.O_WRONLY | os.O_CREAT)
writes = []
for _ in range(n):
    t = time.perf_counter()
    os.pwrite(fd, os.urandom(4096), random.randrange(4096) << 12)
    os.fsync(fd)
    writes.append(time.perf_counter() - t)
print(json.dumps({"reads": reads, "writes": writes}))
"""
# Direct I/O so the guest's page cache cannot absorb it: every byte reaches the host.
NOISE = ("n=0; while :; do dd if=/dev/zero of=/root/noise bs=1M count=128 oflag=direct"
         " 2>/dev/null; dd if=/root/noise of=/dev/null bs=1M iflag=direct 2>/dev/null;"
         " n=$((n+1)); echo $n > /root/rounds; done")  # fmt: skip
NOISE_ROUND_MB = 2 * 128 * 1.048576  # written and read back, per round

DOWNLOAD = """
import http.client, json, sys, time
n, size, loop = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "loop"
rates = []
while True:
    for _ in range(n):
        c = http.client.HTTPConnection("other.test", 80, timeout=120)
        t = time.perf_counter()
        c.request("GET", f"/bytes/{size}")
        r = c.getresponse()
        got = 0
        while chunk := r.read(1 << 16):
            got += len(chunk)
        rates.append(got / (time.perf_counter() - t) / 1e6)
        c.close()
    if not loop:
        break
print(json.dumps(rates))
"""


async def disk_phase(rt: LocalRuntime, shares: Shares, samples: int) -> dict[str, Any]:
    rt.driver.shares = shares
    quiet = await Machine.boot(rt.driver, rt.pool, rt.images)
    noisy = await Machine.boot(rt.driver, rt.pool, rt.images)
    try:
        probe = ["python3", "-c", PROBE, str(samples)]
        await quiet.agent.run(["python3", "-c", PROBE, "1"], timeout=600)  # its file, written
        alone = json.loads((await quiet.agent.run(probe, timeout=900)).stdout)
        noise = asyncio.ensure_future(noisy.agent.run(["timeout", "900", "sh", "-c", NOISE],
                                                      timeout=1000))  # fmt: skip
        await asyncio.sleep(3)  # at full pressure before the quiet guest starts
        started = time.monotonic()
        rounds = await noisy.agent.run(["cat", "/root/rounds"], timeout=60)
        loaded = json.loads((await quiet.agent.run(probe, timeout=900)).stdout)
        after = await noisy.agent.run(["cat", "/root/rounds"], timeout=60)
        noise_mb_s = (
            (int(after.stdout or 0) - int(rounds.stdout or 0))
            * NOISE_ROUND_MB
            / (time.monotonic() - started)
        )
        noise.cancel()
    finally:
        await quiet.close()
        await noisy.close()
    out: dict[str, Any] = {"noisy_mb_s": round(noise_mb_s, 1)}
    for kind in ("reads", "writes"):
        out[f"{kind}_alone"] = percentiles(alone[kind])
        out[f"{kind}_loaded"] = percentiles(loaded[kind])
        for q in ("p50", "p99"):
            out[f"{kind}_{q}_ratio"] = round(
                out[f"{kind}_loaded"][f"{q}_ms"] / out[f"{kind}_alone"][f"{q}_ms"], 2
            )
    return out


def _download(netns: str, count: int, size: int, loop: bool) -> subprocess.Popen[str]:
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", DOWNLOAD, str(count), str(size),
            "loop" if loop else "once"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rates(proc: subprocess.Popen[str], timeout: float) -> list[float]:
    out, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"download failed: {err[-2000:]}")
    rates: list[float] = json.loads(out)
    return rates


async def network_phase(shares: Shares, mb: int, streams: int) -> dict[str, Any]:
    size = mb * 1_000_000
    with tempfile.TemporaryDirectory(prefix="space-bench-shares-") as tmp:
        manager = NetworkManager(replace(NET_CONFIG, rate_mbit=shares.net_mbit))
        world = World(Path(tmp), manager=manager, limits={})
        try:
            await world.start()
            policy = Policy(hosts=[HostRule(pattern="other.test")])
            quiet = await world.add_guest("quiet", policy)
            noisy = await world.add_guest("noisy", policy)
            alone = await asyncio.to_thread(_rates, _download(quiet.netns, 3, size, False), 900)
            noise = [_download(noisy.netns, 1, size, True) for _ in range(streams)]
            await asyncio.sleep(3)
            loaded = await asyncio.to_thread(_rates, _download(quiet.netns, 3, size, False), 900)
            for proc in noise:
                proc.kill()
                proc.wait()
        finally:
            await world.stop()
    return {"mb_s_alone": round(max(alone), 1), "mb_s_loaded": round(max(loaded), 1),
            "throughput_ratio": round(max(alone) / max(loaded), 2)}  # fmt: skip


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"shares": asdict(DEFAULT)}
    rt = await local_runtime()
    for label, shares in (("shared", DEFAULT), ("unlimited", NONE)):
        results[f"disk_{label}"] = await disk_phase(rt, shares, args.samples)
        results[f"network_{label}"] = await network_phase(shares, args.mb, args.streams)
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["what the quiet sandbox sees     shared   unlimited   (loaded / alone)"]
    rows = (("4 KiB random read p50", "disk", "reads_p50_ratio"),
            ("4 KiB random read p99", "disk", "reads_p99_ratio"),
            ("4 KiB write+fsync p50", "disk", "writes_p50_ratio"),
            ("4 KiB write+fsync p99", "disk", "writes_p99_ratio"),
            ("download throughput drop", "network", "throughput_ratio"))  # fmt: skip
    for label, part, field in rows:
        s, u = (results[f"{part}_{x}"][field] for x in ("shared", "unlimited"))
        lines.append(f"{label:<30} {s:>6}x   {u:>8}x")
    s, u = (results[f"disk_{x}"]["noisy_mb_s"] for x in ("shared", "unlimited"))
    lines.append(f"{'noisy neighbour disk, MB/s':<30} {s:>7}   {u:>9}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=300, help="reads and writes, per probe")
    p.add_argument("--mb", type=int, default=64, help="each download's size")
    p.add_argument("--streams", type=int, default=4, help="the noisy guest's downloads at once")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    started = time.monotonic()
    results = asyncio.run(bench(args))
    results["seconds"] = round(time.monotonic() - started)
    flat = {f"{p}_{k}": v for p, r in results.items() if p.startswith("disk_")
            for k, v in r.items() if isinstance(v, dict)}  # fmt: skip
    print("\n".join(percentile_table(flat)))
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

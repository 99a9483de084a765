"""Platform duties in a guest: the agent's built-in calls vs the programs the worker used to run.

Every figure has its baseline in the same run, on the same VM (whose programs are untouched):
  - sync: the agent's `sync`  vs  `sync` run in the guest
  - the gateway's CA: `install_ca`  vs  write_file + `sh -c 'cat … > bundle'`
  - two volumes mounted and unmounted: `mount_volumes` + `unmount`  vs  the shell mount script
    + `sh -c 'sync; umount …'`
  - the root file system grown by 16 MiB: `grow_root_fs`  vs  `resize2fs /dev/vda`
  - ingress, one small HTTP exchange: `tcp_connect`  vs  `python3 -c RELAY` in the guest
  - ingress, 16 MB of HTTP response: the same two, in MB/s

Run as root:  .venv/bin/python bench/guest_duties.py [--n 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from space.api.ingress import RELAY
from space.worker.agent_client import AgentClient, GuestVolume
from space.worker.local import local_runtime
from space.worker.machine import Machine
from space.worker.vmm.base import Drive
from vm_runtime import percentile_table, percentiles, timed

# The shell the worker ran in the guest to mount volumes before the agent did it itself: the
# baseline the built-in call is measured against.
MOUNT_SCRIPT = """
set -e
find_disk() {
  for d in /sys/block/vd*; do
    if [ "$(cat $d/serial)" = "$1" ]; then echo ${d##*/}; return; fi
  done
}
while [ $# -gt 0 ]; do
  serial=$1 target=$2 options=$3; shift 3
  disk=$(find_disk $serial)
  [ -n "$disk" ] || { echo "volume $serial is not attached" >&2; exit 1; }
  mkdir -p "$target"
  mount -t ext4 -o "$options" /dev/$disk "$target"
done
"""
PEM = b"-----BEGIN CERTIFICATE-----\nMIIBbench\n-----END CERTIFICATE-----\n"
BIG = 16_000_000
HTTP_PORT = 8000


def volume(image: Path) -> None:
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)


async def old_install_ca(a: AgentClient) -> None:
    await a.write_file("/etc/space/ca.pem", PEM, make_parents=True)
    script = "cat /etc/ssl/certs/ca-certificates.crt /etc/space/ca.pem > /etc/space/ca-bundle.pem"
    assert (await a.run(["/bin/sh", "-c", script], timeout=30)).ok


async def old_volumes(a: AgentClient) -> None:
    args = ["vol-a", "/mnt/a", "rw", "vol-b", "/mnt/b", "rw"]
    r = await a.run(["/bin/sh", "-c", MOUNT_SCRIPT, "mount-volumes", *args], timeout=30)
    assert r.ok, r.stderr
    r = await a.run(["/bin/sh", "-c", 'sync; umount "$@"', "umount", "/mnt/a", "/mnt/b"])
    assert r.ok, r.stderr


async def new_volumes(a: AgentClient) -> None:
    await a.mount_volumes([GuestVolume("vol-a", "/mnt/a"), GuestVolume("vol-b", "/mnt/b")])
    assert (await a.unmount(["/mnt/a", "/mnt/b"])).ok


def request(path: str) -> bytes:
    return f"GET {path} HTTP/1.0\r\nHost: localhost:{HTTP_PORT}\r\n\r\n".encode()


async def via_tcp(a: AgentClient, path: str) -> bytes:
    async with await a.tcp_connect(HTTP_PORT) as stream:
        await stream.write(request(path))
        await stream.close_write()
        return b"".join([chunk async for chunk in stream])


async def via_relay(a: AgentClient, path: str) -> bytes:
    argv = ["python3", "-c", RELAY, str(HTTP_PORT)]
    r = await a.run(argv, input=request(path), timeout=60, max_output=BIG + 4096)
    assert r.ok, r.stderr
    return r.stdout


async def rate(n: int, fetch: Callable[[], Awaitable[bytes]]) -> float:
    """MB/s of the best of `n` fetches of the big file."""
    best = 0.0
    for _ in range(n):
        t = time.perf_counter()
        body = await fetch()
        best = max(best, len(body) / (time.perf_counter() - t) / 1e6)
        assert len(body) > BIG, len(body)
    return best


async def bench(n: int) -> dict[str, Any]:
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    out: dict[str, Any] = {"host": {"accel": rt.driver.accel, "cpus": os.cpu_count(),
                                    "kernel": platform.release()}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        drives = []
        for name in ("vol-a", "vol-b"):
            image = Path(tmp) / f"{name}.img"
            await asyncio.to_thread(volume, image)
            drives.append(Drive(image, name))
        async with await Machine.boot(rt.driver, rt.pool, rt.images, drives=tuple(drives)) as m:
            a = m.agent
            print("sync", file=sys.stderr)
            out["sync_agent"] = percentiles(await timed(n, a.sync))
            out["sync_program"] = percentiles(await timed(n, lambda: a.run(["sync"])))
            print("install_ca", file=sys.stderr)
            out["ca_agent"] = percentiles(await timed(n, lambda: a.install_ca(PEM)))
            out["ca_shell"] = percentiles(await timed(n, lambda: old_install_ca(a)))
            print("volumes", file=sys.stderr)
            out["volumes_agent"] = percentiles(await timed(n, lambda: new_volumes(a)))
            out["volumes_shell"] = percentiles(await timed(n, lambda: old_volumes(a)))
            print("grow root fs", file=sys.stderr)
            samples: list[float] = []  # resize2fs alone: its wait for the new size is not timed

            async def grow(with_agent: bool) -> None:
                size = m.disk.stat().st_size + (16 << 20)
                await m.vm.resize_disk(size)
                if with_agent:
                    await a.grow_root_fs(min_size=size)
                else:
                    await asyncio.sleep(0.2)  # for the guest to learn of the new size
                    t = time.perf_counter()
                    assert (await a.run(["resize2fs", "/dev/vda"], timeout=120)).ok
                    samples.append(time.perf_counter() - t)

            out["grow_agent"] = percentiles(await timed(n // 2, lambda: grow(True)))
            for _ in range(n // 2):
                await grow(False)
            out["grow_resize2fs"] = percentiles(samples)
            print("ingress", file=sys.stderr)
            await a.run(f"mkdir -p /srv/www && echo hello > /srv/www/small && "
                        f"head -c {BIG} /dev/urandom > /srv/www/big")  # fmt: skip
            server = await a.exec(["python3", "-m", "http.server", "-b", "127.0.0.1",
                                   "-d", "/srv/www", str(HTTP_PORT)])  # fmt: skip
            for _ in range(100):
                try:
                    await via_tcp(a, "/small")
                    break
                except Exception:
                    await asyncio.sleep(0.2)
            out["http_tcp_connect"] = percentiles(await timed(n, lambda: via_tcp(a, "/small")))
            out["http_python_relay"] = percentiles(await timed(n, lambda: via_relay(a, "/small")))
            out["http_16mb_tcp_connect_mb_s"] = await rate(3, lambda: via_tcp(a, "/big"))
            out["http_16mb_python_relay_mb_s"] = await rate(3, lambda: via_relay(a, "/big"))
            server.drop()
    return out


def table(results: dict[str, Any]) -> str:
    lines = percentile_table(results)
    lines.append(
        f"16 MB HTTP response: tcp_connect {results['http_16mb_tcp_connect_mb_s']:.1f} MB/s, "
        f"python3 relay {results['http_16mb_python_relay_mb_s']:.1f} MB/s"
    )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = await bench(args.n)
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())

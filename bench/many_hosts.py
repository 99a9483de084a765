"""Many hosts on one machine: a resume on another host against a resume on the same one, the
first pull of a template per GiB, and creates per second as hosts are added.

Each host is a worker with a pool of its own (nothing on disk is shared) and the registry is
Debian's docker-registry on loopback, so a move really pushes and pulls every byte. Baselines
in the same run:
  - resume on another host (its own host stopped with SIGSTOP until it is lost, so the
    snapshot is pulled from the registry)  vs  resume on the same host;
  - the first pull of a template (registry to a new host)  vs  a local copy of the same files
    on the same file system (`cp --sparse=always`), both until on disk, and the push that put
    it there;
  - creates per second with 1, 2, … hosts: every host shares this machine's 2 cores, so the
    figure cannot grow with hosts here; what each host costs at rest (its worker's and
    gateway's memory and CPU) is measured beside it.

Run as root:  .venv/bin/python bench/many_hosts.py [--runs 6] [--hosts 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from report import emit
from services import UNLIMITED, BenchPlatform, platform
from space.db.store import Store, connect
from space.settings import RegistrySettings
from space.worker.artifacts import Artifacts
from vm_runtime import percentile_table, percentiles

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.registry import serve_registry  # the tests' registry, run as they run it

SHAPE = {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024}
CLIENTS = 8


async def setup(store: Store) -> dict[str, str]:
    tenant = await store.create_tenant("bench")
    return {"key": await store.create_api_key(tenant.id, "bench", admin=True)}


@contextmanager
def registry() -> Iterator[str]:
    tmp = Path(tempfile.mkdtemp(prefix="space-bench-registry-"))
    serving = serve_registry(tmp)
    try:
        yield next(serving).host
    finally:
        serving.close()
        shutil.rmtree(tmp, ignore_errors=True)


def worker_of(p: BenchPlatform, key: str, sid: str) -> str:
    with p.client(key) as c:
        return str(c.get(f"/v1/sandboxes/{sid}").json()["worker_id"])


def wait_state(c: httpx.Client, sid: str, want: str, timeout: float = 300) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sb: dict[str, Any] = c.get(f"/v1/sandboxes/{sid}").json()
        if sb["state"] == want:
            return sb
        if sb["state"] == "error":
            raise RuntimeError(f"{sid}: {sb['reason']}")
        time.sleep(0.05)
    raise TimeoutError(f"{sid} not {want} in {timeout} s")


def stdout(c: httpx.Client, sid: str, cmd: str) -> bytes:
    r = c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line]
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == "stdout")


def exec_ok(c: httpx.Client, sid: str) -> None:
    assert stdout(c, sid, "cat /root/kept") == b"kept\n"


def suspended_sandbox(c: httpx.Client) -> str:
    r = c.post("/v1/sandboxes", json=SHAPE)
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    stdout(c, sid, "echo kept > /root/kept; sync")
    r = c.post(f"/v1/sandboxes/{sid}/suspend")
    assert r.status_code == 200 and r.json()["state"] == "suspended", r.text
    return sid


def timed_resume(c: httpx.Client, sid: str) -> float:
    """From the request to the first command answered in the resumed guest."""
    t = time.perf_counter()
    c.post(f"/v1/sandboxes/{sid}/resume")
    wait_state(c, sid, "running")
    exec_ok(c, sid)
    return time.perf_counter() - t


def worker_states(p: BenchPlatform) -> dict[str, str]:
    async def read() -> dict[str, str]:
        store = Store(connect(p.database_url, pool_size=1))
        try:
            return {w["id"]: w["state"] for w in await store.workers()}
        finally:
            await store.close()

    return asyncio.run(read())


def wait_workers(p: BenchPlatform, ids: list[str], state: str = "active") -> None:
    while any(worker_states(p).get(i) != state for i in ids):
        time.sleep(0.2)


def resumes(p: BenchPlatform, key: str, runs: int) -> dict[str, Any]:
    same, other = [], []
    with p.client(key) as c:
        for _ in range(runs):
            sid = suspended_sandbox(c)
            same.append(timed_resume(c, sid))
            c.delete(f"/v1/sandboxes/{sid}")
            sid = suspended_sandbox(c)
            home = worker_of(p, key, sid)
            proc = p.procs["worker" if home == p.worker_id else home]
            os.kill(proc.pid, signal.SIGSTOP)  # its host is lost: the snapshot must move
            try:
                wait_workers(p, [home], "lost")
                other.append(timed_resume(c, sid))
                assert worker_of(p, key, sid) != home
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            wait_workers(p, [home])
            c.delete(f"/v1/sandboxes/{sid}")
    return {"resume_same_host": percentiles(same), "resume_other_host": percentiles(other)}


def data_bytes(root: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in root.rglob("*") if f.is_file())


def pulls(registry_host: str) -> dict[str, Any]:
    """The largest template image in the cache, pushed and pulled as a template bundle."""
    images = sorted(Path("/var/cache/space/templates").glob("*/*/rootfs.ext4"),
                    key=lambda f: f.stat().st_blocks)  # fmt: skip
    image = images[-1]
    work = Path("/var/lib/space/pool/hosts/bench-pulls")
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    subprocess.run(["cp", "--sparse=always", str(image), str(src / "rootfs.ext4")], check=True)
    gib = data_bytes(src) / (1 << 30)
    store = Artifacts(RegistrySettings(url=f"{registry_host}/bench", insecure=True))
    try:
        t = time.perf_counter()
        pushed = asyncio.run(store.push("template", "pulled", "one", src, {}))
        push_s = time.perf_counter() - t
        os.sync()
        t = time.perf_counter()
        asyncio.run(store.pull(pushed.reference, "template", "pulled", work / "pulled"))
        os.sync()  # on disk, as the copy below
        pull_s = time.perf_counter() - t
        t = time.perf_counter()
        (work / "copied").mkdir()
        subprocess.run(["cp", "--sparse=always", "--reflink=never", str(src / "rootfs.ext4"),
                        str(work / "copied" / "rootfs.ext4")], check=True)  # fmt: skip
        os.sync()
        copy_s = time.perf_counter() - t
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"template": image.parent.parent.name, "data_gib": round(gib, 3),
            "chunks": pushed.blobs, "push_s_per_gib": push_s / gib, "pull_s_per_gib": pull_s / gib,
            "local_copy_s_per_gib": copy_s / gib}  # fmt: skip


def creates_per_second(p: BenchPlatform, key: str, seconds: float) -> float:
    """CLIENTS clients creating and deleting sandboxes for `seconds`: creates finished a second."""
    stop = time.monotonic() + seconds

    def client() -> int:
        done = 0
        with p.client(key) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/sandboxes", json=SHAPE)
                if r.status_code == 201 and r.json()["state"] == "running":
                    done += 1
                    c.delete(f"/v1/sandboxes/{r.json()['id']}", params={"wait": "false"})
        return done

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        total = sum(pool.map(lambda _: client(), range(CLIENTS)))
    return total / (time.perf_counter() - t)


def warm(p: BenchPlatform, key: str, hosts: int) -> None:
    """One sandbox per host at once, so every host has made its base snapshot."""
    with p.client(key) as c:
        made = [c.post("/v1/sandboxes", json=SHAPE).json() for _ in range(hosts)]
        for sb in made:
            c.delete(f"/v1/sandboxes/{sb['id']}")


def at_rest(p: BenchPlatform, host: str, seconds: float = 10.0) -> dict[str, float]:
    """A host's worker and gateway at rest: memory (RSS) and share of a core."""
    proc = p.procs["worker" if host == p.worker_id else host]
    gateway = subprocess.run(["pgrep", "-f", f"gateway-{host} "], capture_output=True, text=True)
    pids = [proc.pid, *(int(x) for x in gateway.stdout.split())]

    def cpu() -> float:
        total = 0
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    before = cpu()
    time.sleep(seconds)
    rss = sum(int(line.split()[1]) for pid in pids
              for line in Path(f"/proc/{pid}/status").read_text().splitlines()
              if line.startswith("VmRSS"))  # fmt: skip
    return {"rss_mib": rss / 1024, "cpu_share": (cpu() - before) / seconds}


def table(results: dict[str, Any]) -> str:
    lines = percentile_table(results)
    pull = results["pull"]
    lines += ["", f"template {pull['template']}: {pull['data_gib']:.2f} GiB of data, "
              f"{pull['chunks']} chunks", f"  first pull   {pull['pull_s_per_gib']:.1f} s/GiB",
              f"  push         {pull['push_s_per_gib']:.1f} s/GiB",
              f"  local copy   {pull['local_copy_s_per_gib']:.1f} s/GiB (baseline)", "",
              "hosts  creates/s  a host at rest: worker+gateway RSS, share of a core"]  # fmt: skip
    for row in results["scaling"]:
        rest = f"{row['rest_rss_mib']:.0f} MiB, {row['rest_cpu_share'] * 100:.1f} %"
        lines.append(f"{row['hosts']:>5}  {row['creates_per_s']:>9.2f}  {rest}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--hosts", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--json", type=str, help="also write the results here")
    args = parser.parse_args()
    os.environ.update(UNLIMITED, SPACE_WORKER_LOST_AFTER="2")
    results: dict[str, Any] = {"hosts": args.hosts, "runs": args.runs, "clients": CLIENTS}
    with registry() as host:
        os.environ.update(SPACE_REGISTRY=f"{host}/space", SPACE_REGISTRY_INSECURE="1")
        with platform(setup) as (p, made):
            key = made["key"]
            p.wait_worker(key)
            results["scaling"] = []
            for n in range(1, args.hosts + 1):
                if n > 1:
                    p.add_host()
                    wait_workers(p, p.hosts)
                warm(p, key, n)
                rate = creates_per_second(p, key, args.seconds)
                rest = [at_rest(p, h) for h in [p.worker_id, *p.hosts]]
                results["scaling"].append({
                    "hosts": n, "creates_per_s": rate,
                    "rest_rss_mib": sum(r["rss_mib"] for r in rest) / n,
                    "rest_cpu_share": sum(r["cpu_share"] for r in rest) / n,
                })  # fmt: skip
            results.update(resumes(p, key, args.runs))
        results["pull"] = pulls(host)
    print(table(results), file=sys.stderr)
    emit(results, args.json)


if __name__ == "__main__":
    main()

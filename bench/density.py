"""Density benchmark: how many idle sandboxes one host holds, and what each costs.

In phases, a fresh platform each, in one run:
  - anonymous: guest RAM copied out of the base snapshot into each VM, KSM off (the baseline:
    SPACE_WORKER_MAPPED_MEMORY=0)
  - mapped: the base snapshot's memory file mapped by every clone (the default), KSM off
  - mapped+ksm: the same with ksmd merging what clones wrote alike (SPACE_WORKER_KSM=on)
  - mapped-unjailed: mapped, with VMMs run unconfined (SPACE_WORKER_JAIL=0): the jail's cost
idle 256 MiB sandboxes are created (each answers one exec, then idles) until admission refuses
one or `--max` run; at 0, 50 and 100 running (and at the end) it measures
  - PSS per sandbox: the VMM processes' proportional set size, summed over the worker's VMMs
    and divided by their count (merged pages count once in all)
  - idle CPU per sandbox: the VMMs' CPU time over a quiet window, per sandbox, in % of a core
  - what KSM merged away, and ksmd's CPU over the same window
  - exec round trip (create → `true` answered) on one sandbox made before the others, and on
    every idle sandbox at the end
  - warm-pool hit latency (a pool of 2; untimed waits for it to refill between hits)
then how fast a create the platform cannot place is answered (503 and its reason). The empty
host (0 running) is the baseline of every ratio.

Run as root:  .venv/bin/python bench/density.py [--max 140] [--phases anonymous,mapped,mapped+ksm]
                [--json out.json]
(SPACE_WORKER_MEMORY_MIB=4096 fills the host after a few dozen, to time the refusals.)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from services import UNLIMITED, BenchPlatform, platform
from space.worker import ksm
from space.worker.local import local_runtime
from space.worker.sandboxes.usage import pss_bytes
from space.worker.vmm.process import vmm_pids
from spinup import first_exec, set_pool, setup, wait_pool
from vm_runtime import percentiles

SHAPE = {"vcpus": 1, "memory_mib": 256, "disk_mib": 1024}
# The run outlasts the default timeout (300 s, then a pause): idle must stay running.
CREATE = {**SHAPE, "timeout_s": 7200}
POOL = 2
LEVELS = (0, 50, 100)
WINDOW_S = 10.0  # the quiet window idle CPU is measured over
TICK = os.sysconf("SC_CLK_TCK")
PHASES: dict[str, dict[str, str]] = {
    "anonymous": {"SPACE_WORKER_MAPPED_MEMORY": "0", "SPACE_WORKER_KSM": "off"},
    "mapped": {"SPACE_WORKER_MAPPED_MEMORY": "1", "SPACE_WORKER_KSM": "off"},
    "mapped+ksm": {"SPACE_WORKER_MAPPED_MEMORY": "1", "SPACE_WORKER_KSM": "on"},
    # The jail's cost: every phase above runs jailed VMMs (the default).
    "mapped-unjailed": {
        "SPACE_WORKER_MAPPED_MEMORY": "1",
        "SPACE_WORKER_KSM": "off",
        "SPACE_WORKER_JAIL": "0",
    },
}


def cpu_seconds(pid: int) -> float:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def vmms(vms_dir: Path) -> list[int]:
    return [pid for d in vms_dir.iterdir() for pid in vmm_pids(d)] if vms_dir.exists() else []


def exec_rtt(c: httpx.Client, sid: str) -> float:
    t = time.perf_counter()
    first_exec(c, sid)
    return time.perf_counter() - t


def hits(p: BenchPlatform, key: str, admin: str, n: int) -> dict[str, float] | None:
    samples = []
    with p.client(key) as c:
        for _ in range(n):
            # A host full by vCPUs (members hold them too) refills no member: no hits there.
            if not wait_pool(p, admin, POOL, within_s=60):
                return None
            t = time.perf_counter()
            r = c.post("/v1/sandboxes", json=CREATE)
            samples.append(time.perf_counter() - t)
            assert r.status_code == 201 and r.json()["boot"] == "pool", r.text
            c.delete(f"/v1/sandboxes/{r.json()['id']}", params={"wait": "false"})
    return percentiles(samples)


def measure(
    p: BenchPlatform, key: str, admin: str, probe: str, vms_dir: Path, n: int
) -> dict[str, Any]:
    pids = vmms(vms_dir)
    merged0, cpu0 = ksm.figures(), {pid: cpu_seconds(pid) for pid in pids}
    time.sleep(WINDOW_S)
    merged1 = ksm.figures()
    idle_cpu = sum(cpu_seconds(pid) - c0 for pid, c0 in cpu0.items())
    pss = sum(pss_bytes(pid) or 0 for pid in pids)
    with p.client(key) as c:
        rtt = percentiles([exec_rtt(c, probe) for _ in range(10)])
    ksmd = None
    if merged0 and merged1 and merged0.cpu_seconds is not None and merged1.cpu_seconds is not None:
        ksmd = (merged1.cpu_seconds - merged0.cpu_seconds) / WINDOW_S * 100
    return {
        "running": n,
        "vmms": len(pids),
        "pss_mib_per_sandbox": pss / len(pids) / 2**20 if pids else 0.0,
        "idle_cpu_pct_per_sandbox": idle_cpu / WINDOW_S * 100 / len(pids) if pids else 0.0,
        "ksm_saved_mib": merged1.saved_bytes / 2**20 if merged1 else 0.0,
        "ksmd_cpu_pct": ksmd,
        "exec_rtt": rtt,
        "hit": hits(p, key, admin, 5),
    }


def refusal(p: BenchPlatform, key: str, made: list[str]) -> dict[str, Any]:
    """Creates the platform cannot place: how fast each 503 comes, and what it says; beside
    each, as the baseline, the same API's answer to a read of the tenant's quotas (no worker).
    A create that finds room after all (the measurement caught up) is kept in `made`, and the
    host filled on until 20 refusals are timed."""
    samples: list[float] = []
    reads: list[float] = []
    detail = ""
    with p.client(key) as c:
        for _ in range(100):
            t = time.perf_counter()
            c.get("/v1/quotas").raise_for_status()
            reads.append(time.perf_counter() - t)
            t = time.perf_counter()
            r = c.post("/v1/sandboxes", json=CREATE)
            took = time.perf_counter() - t
            if r.status_code == 201:
                made.append(r.json()["id"])
                continue
            assert r.status_code == 503 and "Retry-After" in r.headers, (r.status_code, r.text)
            if _full(r.json()["detail"]):
                samples.append(took)
                detail = r.json()["detail"]
            if len(samples) == 20:
                break
    if not samples:
        return {"refused": False}
    return {"refused": True, "answer": percentiles(samples), "baseline_read": percentiles(reads),
            "detail": detail, "held_then": len(made)}  # fmt: skip


def phase(mode: str, most: int) -> dict[str, Any]:
    vms_root = asyncio.run(local_runtime()).pool.root / "workers"
    with platform(setup, **PHASES[mode]) as (p, keys):
        key, admin = keys["key"], keys["admin"]
        vms_dir = vms_root / p.worker_id / "vms"
        p.wait_worker(key)
        with p.client(key) as c:
            probe = c.post("/v1/sandboxes", json=CREATE).json()["id"]  # the base snapshot too
            first_exec(c, probe)
        set_pool(p, admin, POOL)
        wait_pool(p, admin, POOL)
        levels = [measure(p, key, admin, probe, vms_dir, 0)]
        print(f"  {mode}: baseline measured", flush=True)
        made: list[str] = []
        errors: list[str] = []  # creates the API took and the worker refused
        transient: list[str] = []  # 503s that were not for room, asked again
        refused_at: int | None = None

        def one(_: int) -> str | None:
            """A new idle sandbox; None if the platform refused it (503 from the API, or an
            error from the worker's own admission, which the run counts apart)."""
            with p.client(key) as c:
                r = c.post("/v1/sandboxes", json=CREATE)
                while r.status_code == 503 and not _full(r.json()["detail"]):
                    # Not a refusal for room (a worker missed its probes on a host this busy):
                    # asked again after the time it names.
                    transient.append(r.json()["detail"])
                    time.sleep(int(r.headers.get("Retry-After", "1")))
                    r = c.post("/v1/sandboxes", json=CREATE)
                if r.status_code == 503:
                    return None
                assert r.status_code == 201, r.text
                if r.json()["state"] != "running":
                    errors.append(str(r.json()["reason"]))
                    c.delete(f"/v1/sandboxes/{r.json()['id']}", params={"wait": "false"})
                    return None
                first_exec(c, r.json()["id"])
                return str(r.json()["id"])

        for level in sorted({*(n for n in LEVELS[1:] if n < most), most}):
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                while len(made) < level and refused_at is None:
                    batch = list(ex.map(one, range(min(4, level - len(made)))))
                    made += [sid for sid in batch if sid]
                    if None in batch:
                        refused_at = len(made)
            print(f"  {mode}: {len(made)} idle sandboxes", flush=True)
            if len(made) >= level or refused_at is not None:
                levels.append(measure(p, key, admin, probe, vms_dir, len(made)))
            if refused_at is not None:
                break
        with p.client(key) as c:
            every = percentiles([exec_rtt(c, sid) for sid in made])
        full = refusal(p, key, made) if refused_at is not None else {"refused": False}
        with p.client(admin) as c:
            workers = c.get("/v1/workers").json()["items"]
        with p.client(key) as c:
            for sid in [*made, probe]:
                c.delete(f"/v1/sandboxes/{sid}", params={"wait": "false"})
    return {"phase": mode, "levels": levels, "held": len(made), "refused_at": refused_at,
            "exec_rtt_every_idle_sandbox": every, "full": full, "worker": workers,
            "refused_by_the_worker": errors, "refused_for_a_while": transient}  # fmt: skip


def _full(detail: str) -> bool:
    """A 503 for want of room (not a worker away or busy)."""
    return "MiB in use" in detail or "vCPUs in use" in detail


def table(results: dict[str, Any]) -> str:
    rows = [("phase", "running", "PSS MiB/sb", "idle CPU %/sb", "KSM saved MiB", "ksmd %",
             "exec p50 ms", "hit p50 ms")]  # fmt: skip
    for ph in results["phases"]:
        for lv in ph["levels"]:
            ksmd = lv["ksmd_cpu_pct"]
            rows.append((
                ph["phase"], str(lv["running"]), f"{lv['pss_mib_per_sandbox']:.0f}",
                f"{lv['idle_cpu_pct_per_sandbox']:.2f}", f"{lv['ksm_saved_mib']:.0f}",
                "-" if ksmd is None else f"{ksmd:.1f}",
                f"{lv['exec_rtt']['p50_ms']:.0f}",
                f"{lv['hit']['p50_ms']:.0f}" if lv["hit"] else "pool full",
            ))  # fmt: skip
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, width, strict=True)) for r in rows]
    for ph in results["phases"]:
        full = ph["full"]
        said = (f"refused at {ph['refused_at']} (503 p50 {full['answer']['p50_ms']:.0f} ms, "
                f"p99 {full['answer']['p99_ms']:.0f} ms; a quota read p50 "
                f"{full['baseline_read']['p50_ms']:.0f} ms: {full['detail'][:100]})"
                if full.get("refused") else "never refused")  # fmt: skip
        e = ph["exec_rtt_every_idle_sandbox"]
        lines.append(f"{ph['phase']}: held {ph['held']} idle sandboxes, {said}; exec on every "
                     f"idle one p50 {e['p50_ms']:.0f} ms p99 {e['p99_ms']:.0f} ms")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    os.environ.update(UNLIMITED)  # the platform's services inherit them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=140, help="idle sandboxes at most")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--phases", default=",".join(PHASES), help="of " + ", ".join(PHASES))
    args = parser.parse_args()
    modes = args.phases.split(",")
    if unknown := [m for m in modes if m not in PHASES]:
        parser.error(f"unknown phases {unknown}: pick from {', '.join(PHASES)}")
    results = {"phases": [phase(mode, args.max) for mode in modes]}
    print(table(results))
    print(json.dumps(results, indent=2, default=str))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()

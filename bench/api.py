"""Control-plane benchmark: the API's cost over the runtime beneath it.

  - create → first exec answered, through the API (no warm pool)  vs  a restore straight on the
    runtime (Machine.restore + exec): what the control plane adds to a create
  - exec round trip of `true` through the API  vs  straight to the guest agent
  - list latency with 10,000 sandbox rows in the tenant  vs  with 10 rows

Starts its own embedded PostgreSQL, API, controller and worker. Run as root:
  .venv/bin/python bench/api.py [--creates 20] [--execs 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from services import platform
from space.db import tables as t
from space.db.store import Store
from space.worker.local import local_runtime
from space.worker.machine import Machine
from vm_runtime import percentile_table, percentiles


async def setup(store: Store) -> dict[str, str]:
    small = await store.create_tenant(f"bench-{secrets.token_hex(3)}")
    big = await store.create_tenant(f"bench-big-{secrets.token_hex(3)}")
    # 10,000 rows of past sandboxes in one tenant, as an audit history would hold.
    for i in range(0, 10_000, 1000):
        async with store.engine.begin() as c:
            await c.execute(
                t.sandboxes.insert(),
                [
                    dict(
                        id=f"sb-hist-{big.id}-{j}",
                        tenant_id=big.id,
                        template="base",
                        state="deleted",
                        desired_state="deleted",
                        vcpus=1,
                        memory_mib=256,
                        disk_mib=1024,
                        timeout_s=300,
                        timeout_action="pause",
                        metadata={"batch": str(j % 10)},
                    )
                    for j in range(i, i + 1000)
                ],
            )
    return {"key": await store.create_api_key(small.id), "big": await store.create_api_key(big.id)}


def timed(n: int, fn: Any) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def api_exec(c: httpx.Client, sid: str) -> None:
    with c.stream("POST", f"/v1/sandboxes/{sid}/exec", json={"argv": ["true"]}) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


async def direct_baselines(execs: int, creates: int) -> dict[str, Any]:
    rt = await local_runtime()
    origin = await Machine.boot(rt.driver, rt.pool, rt.images)
    snap = await origin.snapshot(rt.pool.snapshots / f"bench-api-{origin.id}")
    await origin.close()
    restores = []
    for _ in range(creates):
        t = time.perf_counter()
        m = await Machine.restore(rt.driver, rt.pool, snap)
        await m.agent.run(["true"])
        restores.append(time.perf_counter() - t)
        await m.close()
    async with await Machine.restore(rt.driver, rt.pool, snap) as m:
        agent_exec = []
        for _ in range(execs):
            t = time.perf_counter()
            await m.agent.run(["true"])
            agent_exec.append(time.perf_counter() - t)
    shutil.rmtree(snap.path)
    return {
        "runtime_restore_to_first_exec": percentiles(restores),
        "agent_exec_true": percentiles(agent_exec),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--execs", type=int, default=200)
    parser.add_argument("--lists", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with platform(setup) as (p, keys):
        c = p.client(keys["key"])
        # The first create builds the worker's base snapshot (a cold boot): not part of the figure.
        c.delete(f"/v1/sandboxes/{c.post('/v1/sandboxes', json={}).json()['id']}")
        creates = []
        for _ in range(args.creates):
            t0 = time.perf_counter()
            sid = c.post("/v1/sandboxes", json={}).json()["id"]
            api_exec(c, sid)
            creates.append(time.perf_counter() - t0)
            c.delete(f"/v1/sandboxes/{sid}")  # one at a time, as the runtime baseline does
        results["api_create_to_first_exec"] = percentiles(creates)
        sid = c.post("/v1/sandboxes", json={}).json()["id"]
        results["api_exec_true"] = percentiles(timed(args.execs, lambda: api_exec(c, sid)))
        c.delete(f"/v1/sandboxes/{sid}")
        results["list_10_rows"] = percentiles(
            timed(args.lists, lambda: c.get("/v1/sandboxes", params={"limit": 50}))
        )
        big = p.client(keys["big"])
        results["list_10000_rows"] = percentiles(
            timed(args.lists, lambda: big.get("/v1/sandboxes", params={"limit": 50}))
        )
        results["list_10000_rows_metadata_filter"] = percentiles(
            timed(
                args.lists,
                lambda: big.get("/v1/sandboxes", params={"limit": 50, "metadata.batch": "3"}),
            )
        )
    results.update(asyncio.run(direct_baselines(args.execs, args.creates)))
    print("\n".join(percentile_table(results)))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""E2B's sandbox metrics, measured on the host as SPACE's stats are (its VMM process, its disk
on the pool), never reported by the guest.

E2B answers a series its daemon sampled every few seconds; SPACE keeps no such series (its
per-minute history is `/v1/usage`), so the answer is one point, now: CPU over the last
`CPU_WINDOW_S`, from two readings of the VMM's CPU time."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Query

from space.api.deps import Svc
from space.e2b.rest import E2BCaller, alive

router = APIRouter(tags=["e2b"])

CPU_WINDOW_S = 0.5
MiB = 1 << 20


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(
    sandbox_id: str,
    svc: Svc,
    who: E2BCaller,
    start: Annotated[int | None, Query(ge=0, description="unix seconds")] = None,
    end: Annotated[int | None, Query(ge=0, description="unix seconds")] = None,
) -> list[dict[str, Any]]:
    """Empty for a paused sandbox (nothing runs), or when [start, end] leaves out now."""
    row = await alive(svc, who, sandbox_id)
    asked = time.time()
    if (
        row["state"] != "running"
        or (start is not None and start > asked + CPU_WINDOW_S + 1)
        or (end is not None and end < int(asked))
    ):
        return []
    worker = await svc.running_on(row)
    first = await svc.workers.stats(worker, sandbox_id)
    await asyncio.sleep(CPU_WINDOW_S)
    now = await svc.workers.stats(worker, sandbox_id)
    # The VMM's CPU time, of all its vCPUs' worth (TCG's own work counts, hence the cap); a
    # VMM started again between the readings counts from zero.
    used = now.cpu_seconds - first.cpu_seconds if now.cpu_seconds >= first.cpu_seconds else 0.0
    pct = min(100.0, 100.0 * used / max(now.at - first.at, 1e-3) / now.vcpus)
    return [
        {
            "timestamp": datetime.fromtimestamp(now.at, UTC).isoformat(),
            "timestampUnix": int(now.at),
            "cpuCount": now.vcpus,
            "cpuUsedPct": round(pct, 2),
            # The guest RAM its VMM touched (and the VMM's own), at most what it was given.
            "memUsed": min(now.memory_bytes, now.memory_mib * MiB),
            "memTotal": now.memory_mib * MiB,
            "memCache": 0,  # the guest's page cache is the guest's to see
            "diskUsed": now.disk_bytes,
            "diskTotal": row["disk_mib"] * MiB,
        }
    ]

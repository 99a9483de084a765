"""What a worker's sandboxes leave on a host, counted where each thing lives.

VMM processes (by their run directories), network namespaces (by the worker's prefix, in
/run/netns), the tap inside each of them, the host ends of their veth pairs (by the worker's
link prefix, in the host's namespace), mounts under the worker's directory or its namespaces,
and the run directories and snapshots on disk.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from space.worker import netsetup

from .vm.conftest import vmm_pids

POOL = Path("/var/lib/space/pool")
NETNS = Path("/run/netns")


def _names(worker_id: str) -> tuple[str, str]:
    config = netsetup._names(worker_id, {"host_range": "10.128.0.0/16", "proxy_port": 0,
                                         "dns_port": 0})  # fmt: skip
    return config.netns_prefix, config.link_prefix


def resources(worker_ids: list[str], pool: Path = POOL) -> dict[str, object]:
    mounts = Path("/proc/mounts").read_text().splitlines()
    out: dict[str, object] = {}
    for wid in worker_ids:
        netns_prefix, link_prefix = _names(wid)
        root = pool / "workers" / wid
        namespaces = (
            sorted(p.name for p in NETNS.glob(f"{netns_prefix}*")) if NETNS.is_dir() else []
        )
        taps = []
        for ns in namespaces:
            links = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True,
                                   text=True, check=False).stdout  # fmt: skip
            taps += [f"{ns}/{line.split(':')[1].strip()}" for line in links.splitlines()
                     if "tun" in line or ": g0" in line]  # fmt: skip
        out[wid] = {
            "vmm": sorted(vmm_pids(root)),
            "netns": namespaces,
            "taps": taps,
            "host_links": sorted(
                n for n in os.listdir("/sys/class/net") if n.startswith(link_prefix)
            ),
            "mounts": sorted(m for m in mounts if str(root) in m or netns_prefix in m),
            "vm_dirs": sorted(p.name for p in (root / "vms").glob("*")),
            "snapshots": sorted(p.name for p in (root / "suspended").glob("*")),
        }
    return out


def counts(worker_ids: list[str], pool: Path = POOL) -> dict[str, int]:
    """The same, as numbers per kind (summed over the workers)."""
    total: dict[str, int] = {}
    for per in resources(worker_ids, pool).values():
        assert isinstance(per, dict)
        for kind, found in per.items():
            total[kind] = total.get(kind, 0) + len(found)
    return total

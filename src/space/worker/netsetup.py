"""A worker's sandbox networking: its own names, address range and ports, and its gateway.

Several workers may share a host (tests do): each gets link and namespace prefixes and an
nftables table derived from its id, an address range no interface of the host uses yet, and
free ports for its gateway. They are chosen once and kept in the worker's directory, so that a
restarted worker finds the networks of the VMs it adopts where it left them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import signal
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute  # type: ignore[import-untyped]

from space.gateway.process import GatewayProcess, GatewaySettings
from space.networks import SANDBOX_RANGES
from space.settings import Settings
from space.worker.network import Egress, NetworkConfig, NetworkManager

log = logging.getLogger(__name__)

SETTINGS_FILE = "network.json"
PID_FILE = "gateway.pid"


async def start_egress(
    settings: Settings, worker_id: str, worker_dir: Path
) -> tuple[Egress, GatewayProcess]:
    """This worker's network manager and a running gateway (a stale one is stopped first)."""
    # pyroute2's synchronous calls run their own event loop: not on ours.
    config = await asyncio.to_thread(
        _config, worker_id, worker_dir / SETTINGS_FILE, settings.worker.net_range
    )
    config = replace(config, rate_mbit=settings.worker.shares.net_mbit)
    state = settings.state_dir / f"gateway-{worker_id}"
    _stop_stale_gateway(state / PID_FILE)
    gw = settings.worker.gateway
    gateway_settings = GatewaySettings(
        state_dir=state,
        control_socket=Path("/run/space") / f"gateway-{worker_id}.sock",
        upstream_dns=gw.upstream_dns or _system_resolver(),
        # CAs to verify origins by when the gateway terminates TLS (default: the system's).
        upstream_ca=gw.upstream_ca,
        ca_dir=gw.ca_dir,
        proxy_port=config.proxy_port,
        dns_port=config.dns_port,
        user=gw.user,  # it drops root once set up
        die_with=os.getpid(),  # however this worker ends, its gateway ends too
        pid_file=state / PID_FILE,
        open_networks=settings.egress_open_networks,
        closed_networks=(str(SANDBOX_RANGES), config.host_range),
    )
    gateway_settings.control_socket.parent.mkdir(parents=True, exist_ok=True)
    gateway = GatewayProcess(gateway_settings)
    client = await gateway.start()
    return Egress(NetworkManager(config), client), gateway


async def remove_networks(worker_id: str, worker_dir: Path, state_dir: Path) -> None:
    """Everything a worker's networking leaves on the host once its VMs are gone for good
    (a decommissioned worker, a test's): namespaces, links, its table, its gateway."""
    _stop_stale_gateway(state_dir / f"gateway-{worker_id}" / PID_FILE)
    # Names come from the id alone, so this works even without the worker's saved settings.
    manager = NetworkManager(_names(worker_id, {"host_range": str(SANDBOX_RANGES), "proxy_port": 0,
                                                "dns_port": 0}))  # fmt: skip
    await manager.sweep()
    await manager.stop()


def _config(worker_id: str, path: Path, net_range: str) -> NetworkConfig:
    tag = hashlib.sha256(worker_id.encode()).hexdigest()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {
            "host_range": net_range or _free_range(int(tag, 16)),
            "proxy_port": _free_port(),
            "dns_port": _free_port(),
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved))
    return _names(worker_id, saved)


def _names(worker_id: str, saved: dict[str, Any]) -> NetworkConfig:
    tag = hashlib.sha256(worker_id.encode()).hexdigest()
    return NetworkConfig(
        host_range=str(saved["host_range"]),
        link_prefix=f"s{tag[:3]}-",  # + 10 hex digits: 15 characters, the kernel's limit
        netns_prefix=f"space-{worker_id}-",
        table="space_" + re.sub(r"[^A-Za-z0-9_]", "_", worker_id),
        proxy_port=int(saved["proxy_port"]),
        dns_port=int(saved["dns_port"]),
    )


def _free_range(start: int) -> str:
    """A /16 of SANDBOX_RANGES that no address or route of the host overlaps, from `start` on."""
    with IPRoute() as ipr:
        used = [
            ipaddress.ip_network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", strict=False)
            for a in ipr.get_addr(family=socket.AF_INET)
        ]
    blocks = list(SANDBOX_RANGES.subnets(new_prefix=16))
    for i in range(len(blocks)):
        block = blocks[(start + i) % len(blocks)]
        if not any(block.overlaps(u) for u in used):
            return str(block)
    raise RuntimeError(f"no free /16 left in {SANDBOX_RANGES} for sandbox networks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _system_resolver() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/resolv.conf").read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                return words[1]
    return "127.0.0.53"


def _stop_stale_gateway(pid_file: Path) -> None:
    """A gateway a killed worker left running holds its ports: stop it (checked by its
    command line, so a reused pid is left alone)."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return
    if b"space.gateway" in cmdline and str(pid_file.parent).encode() in cmdline:
        log.info("stopping the gateway (pid %d) an earlier worker left", pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)

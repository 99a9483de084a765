"""What a sandbox uses, measured on the host and never asked of the guest (whose figures a
hostile guest could make up): its VMM process's CPU time and proportional set size from /proc,
its disk's allocated bytes on the pool, and the byte counters of its tap inside its network
namespace.

Under TCG the VMM's CPU time is the emulation's too: what the host spends on the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from space.worker.network import netns
from space.worker.network.manager import SandboxNetwork
from space.worker.sandboxes.errors import WrongState
from space.worker.sandboxes.records import SandboxVM

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Usage:
    at: float  # unix time of the measurement
    cpu_seconds: float  # user + system time of the VMM process since it started
    memory_bytes: int  # the VMM's proportional set size (guest RAM it touched, and its own)
    disk_bytes: int  # allocated on the pool by the sandbox's disk (shared extents included)
    net_rx_bytes: int | None  # received by the guest's NIC; None: it has none
    net_tx_bytes: int | None  # sent by the guest's NIC (dropped by its policy or not)
    vmm: int  # the VMM's pid: a new VMM (a resume, a reboot) starts the counters again
    vmm_age_s: float  # since the VMM started: how long its counters have been counting


def _stat(pid: int) -> list[str]:
    # Fields after the command name, which may hold spaces and parentheses.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int) -> float:
    fields = _stat(pid)  # utime and stime: the 14th and 15th fields of the whole line
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def age_s(pid: int) -> float:
    """How long the process has run (its start, the 22nd field, in ticks since boot)."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return max(0.0, uptime - int(_stat(pid)[19]) / CLOCK_TICKS)


def pss_bytes(pid: int) -> int | None:
    """The proportional set size of a process (its share of the memory it maps)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return None


def allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def link_bytes(namespace: str, link: str) -> tuple[int, int]:
    """(received, sent) bytes of `link` in a network namespace, as the link counts them."""

    def read() -> str:
        # /proc/thread-self/net is the namespace of the reading thread, which run_in set.
        return Path("/proc/thread-self/net/dev").read_text()

    for line in netns.run_in(namespace, read).splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == link:
            values = counters.split()
            return int(values[0]), int(values[8])
    raise LookupError(f"no link {link} in namespace {namespace}")


def _measure(sb: SandboxVM, net: SandboxNetwork | None) -> Usage:
    machine = sb.live_machine("measure")
    pid = machine.status().pid
    if pid is None:
        raise WrongState(f"VM {sb.id} has no VMM process", sb.state)
    try:
        cpu, pss, age = cpu_seconds(pid), pss_bytes(pid), age_s(pid)
        if pss is None:
            raise FileNotFoundError(pid)
    except (OSError, ValueError, IndexError):
        raise WrongState(f"the VMM of {sb.id} exited", "error") from None
    rx = tx = None
    if net is not None:
        # The tap's receive side is what the guest sent, and the other way round.
        tx, rx = link_bytes(net.netns, net.tap)
    return Usage(time.time(), cpu, pss, allocated_bytes(machine.disk), rx, tx, pid, age)


async def measure(sb: SandboxVM, net: SandboxNetwork | None) -> Usage:
    """The figures of one live VM (WrongState if it has no VMM process now)."""
    return await asyncio.to_thread(_measure, sb, net)


@dataclass(frozen=True)
class Metered:
    """One sandbox as metering sees it: what it used (live), or what its snapshot holds on disk
    (suspended)."""

    id: str
    state: str  # running (unresponsive ones too: their VMM holds what they were given), paused,
    # or suspended
    used: Usage | None = None
    stored_bytes: int = 0  # allocated on the pool by its suspended snapshot


def _stored(directory: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in directory.rglob("*") if p.is_file())


async def meter(sb: SandboxVM, net: SandboxNetwork | None, suspended: Path) -> Metered | None:
    """None for a VM in error (nothing runs, nothing is held beyond its disk) or gone."""
    state = {"unresponsive": "running"}.get(sb.state, sb.state)
    try:
        if state == "suspended":
            stored = await asyncio.to_thread(_stored, suspended / sb.id)
            return Metered(sb.id, state, stored_bytes=stored)
        if state not in ("running", "paused"):
            return None
        return Metered(sb.id, state, used=await measure(sb, net))
    except (WrongState, OSError, LookupError):  # it changed or went away meanwhile
        return None

"""The agent's reserve inside the guest: what the tenant's processes cannot take from it.

The tenant is root in its guest, and its programs may fork without end, fill memory or spin on
every vCPU; the agent must still answer (exec, files, PTYs, suspend, delete). So, as the VM's
init, the agent puts itself in one cgroup (v2) and every process it starts in another:

- `tenant/`: `pids.max` TENANT_PIDS, `cpu.weight` 100, no memory cap of its own (the guest's
  OOM killer picks among the tenant's processes: the agent, PID 1, is never its pick); each
  process the agent starts gets a cgroup of its own below it (`tenant/p<n>`, at most
  ONE_PROCESS_PIDS processes), so that one fork bomb neither takes every pid from the next
  command nor most of the CPU: siblings share the tenant's CPU evenly, whatever they fork;
- `space-agent/`: `memory.min` the reserve (its pages are never reclaimed for the tenant's),
  `cpu.weight` 10000, a hundred times the tenant's share of a busy vCPU.

A process is started from inside `tenant/` (the agent moves itself there for the spawn and back),
so it and everything it forks is counted there from its first instruction.
PID 1 ignores signals it has no handler for, whoever sends them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from .common import log
from .system import mount

ROOT = Path("/sys/fs/cgroup")
AGENT = ROOT / "space-agent"
TENANT = ROOT / "tenant"
TENANT_PIDS = 1024  # a fork bomb past this many processes fails to fork; the agent answers
ONE_PROCESS_PIDS = 768  # what one command the agent started may fork, its own included
RESERVE_MIN = 24 << 20  # bytes of memory kept for the agent, at least
RESERVE_FRACTION = 8  # and at least this part of the guest's memory, up to RESERVE_MAX
RESERVE_MAX = 256 << 20

_active = False
_next = 0
_leaves: list[Path] = []


def set_up() -> bool:
    """Make the two cgroups and move the agent into its own; False (and a log line) if this
    kernel cannot, in which case processes start where the agent is, as before."""
    global _active
    try:
        if not (ROOT / "cgroup.controllers").exists():
            mount("cgroup2", str(ROOT), "cgroup2", 0, "nsdelegate")
        (ROOT / "cgroup.subtree_control").write_text("+cpu +memory +pids")
        for d in (AGENT, TENANT):
            d.mkdir(exist_ok=True)
        total = _mem_total()
        reserve = min(RESERVE_MAX, max(RESERVE_MIN, total // RESERVE_FRACTION))
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
        (TENANT / "pids.max").write_text(str(min(TENANT_PIDS, pid_max // 2)))
        (TENANT / "cpu.weight").write_text("100")
        (TENANT / "cgroup.subtree_control").write_text("+cpu +memory +pids")
        (AGENT / "memory.min").write_text(str(reserve))
        (AGENT / "cpu.weight").write_text("10000")
        (AGENT / "cgroup.procs").write_text(str(os.getpid()))
    except (OSError, ValueError) as e:
        log(f"no reserve for the agent: {e}")
        return False
    _active = True
    return True


@contextlib.contextmanager
def tenant() -> Iterator[None]:
    """While inside, a process the agent starts is born in a cgroup of its own below the
    tenant's."""
    global _next
    if not _active:
        yield
        return
    _reap()
    _next += 1
    leaf = TENANT / f"p{_next}"
    leaf.mkdir()
    (leaf / "pids.max").write_text(str(ONE_PROCESS_PIDS))
    _leaves.append(leaf)
    (leaf / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        (AGENT / "cgroup.procs").write_text(str(os.getpid()))


def end_all(wait_s: float) -> bool:
    """Kill every process the agent started and everything they started (cgroup.kill: a
    daemon that forked away too), then wait up to `wait_s` for them to be gone; False if some
    were still there, or if this kernel gave no cgroups to find them by."""
    if not _active:
        return False
    (TENANT / "cgroup.kill").write_text("1")
    deadline = time.monotonic() + wait_s
    while "populated 1" in (TENANT / "cgroup.events").read_text():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    _reap()
    return True


def _reap() -> None:
    """Remove the cgroups whose processes have all ended."""
    for leaf in list(_leaves):
        try:
            leaf.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # EBUSY: something it started still runs
            continue
        _leaves.remove(leaf)


def _mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError("no MemTotal in /proc/meminfo")

"""Kernel same-page merging under the worker's control.

Sandboxes restored from one base snapshot start with the same guest memory: QEMU marks guest RAM
mergeable (`mem-merge`, on by default) and the kernel's ksmd folds identical pages into one,
copied again only when a guest writes to it. The worker owns its host, so it turns ksmd on (or
off) at start and reports what merging saves and what ksmd costs in CPU. `host` leaves the
kernel's settings as the operator made them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

KSM = Path("/sys/kernel/mm/ksm")
PAGE = os.sysconf("SC_PAGE_SIZE")
Mode = Literal["on", "off", "host"]


@dataclass(frozen=True)
class Figures:
    running: bool
    saved_bytes: int  # guest pages that map a merged page instead of their own
    shared_bytes: int  # the merged pages themselves
    full_scans: int
    cpu_seconds: float | None  # ksmd's CPU time since the host booted


def configure(mode: Mode, pages_to_scan: int, sleep_ms: int, root: Path = KSM) -> str | None:
    """Put ksmd in `mode`; the problem if the host does not let us (None when done)."""
    if mode == "host":
        return None
    if not (root / "run").exists():
        return "this kernel has no KSM (CONFIG_KSM): clones do not share memory"
    values = {"run": "1" if mode == "on" else "0"}
    if mode == "on":
        # Zero pages merge with the kernel's zero page, not with one another: no KSM node each.
        values |= {"pages_to_scan": str(pages_to_scan), "sleep_millisecs": str(sleep_ms),
                   "use_zero_pages": "1"}  # fmt: skip
    try:
        for name, value in values.items():
            (root / name).write_text(value)
    except OSError as e:
        return f"KSM settings not writable ({e}): run the worker as root"
    log.info("KSM %s (%s)", mode, ", ".join(f"{k}={v}" for k, v in values.items()))
    return None


def figures(root: Path = KSM) -> Figures | None:
    def read(name: str) -> int:
        return int((root / name).read_text())

    try:
        return Figures(
            running=read("run") == 1,
            saved_bytes=read("pages_sharing") * PAGE,
            shared_bytes=read("pages_shared") * PAGE,
            full_scans=read("full_scans"),
            cpu_seconds=_ksmd_cpu_seconds(),
        )
    except (OSError, ValueError):
        return None


_ksmd_stat: Path | None = None  # /proc/<pid>/stat of ksmd, once found


def _ksmd_cpu_seconds() -> float | None:
    global _ksmd_stat
    candidates = [_ksmd_stat] if _ksmd_stat else []
    for stat in itertools.chain(candidates, Path("/proc").glob("[0-9]*/stat")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            if text[text.index("(") + 1 : text.rindex(")")] == "ksmd":
                _ksmd_stat = stat
                fields = text[text.rindex(")") + 2 :].split()
                return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None

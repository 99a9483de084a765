"""Named steps where a process can be made to die, for the fault-injection tests.

`SPACE_CRASH_AT=suspend.after-snapshot` (read once by `arm`, from the process's settings) makes
the process kill itself with SIGKILL when it reaches that step, exactly as a power cut or an
OOM kill would stop it there. Unset, `reached()` costs a string comparison.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

_armed: str = ""

# Every step a test may name; `arm` refuses others, so a typo cannot make a test pass silently.
STEPS = frozenset({
    "create.after-network",
    "create.after-vmm",
    "create.before-record",
    "claim.after-record",
    "claim.after-worker",
    "claim.after-identity",
    "suspend.after-snapshot",
    "suspend.after-publish",
    "suspend.after-stop",
    "resume.after-restore",
    "resume.after-consume",
    "resume.after-cont",
    "delete.after-stop",
    "delete.after-files",
    "reconcile.after-worker",
    "template.after-stage",
    "template.after-base",
})  # fmt: skip


def arm(step: str) -> None:
    global _armed
    if step and step not in STEPS:
        raise ValueError(f"SPACE_CRASH_AT: no step {step!r} (known: {', '.join(sorted(STEPS))})")
    _armed = step


def reached(step: str) -> None:
    if _armed and step == _armed:
        log.warning("crash point %s reached: dying now", step)
        os.kill(os.getpid(), signal.SIGKILL)

"""Ctrl-C stops every command at once (the platform's services excepted: they stop on their
own signals, draining what they serve).

The first SIGINT raises KeyboardInterrupt where the command is, so its own handling and clean-up
run (a follower says what it left running, a terminal is restored, connections close); the
command then ends with status 130, as shells expect of an interrupted program. The clean-up of
a command that calls the API may wait on something that does not answer (an API frozen
mid-call): it gets GRACE_S. A command that works on this host stops VMs and processes there,
which is waited for. A second Ctrl-C ends the process at once.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

GRACE_S = 2  # seconds
STATUS = 128 + signal.SIGINT

_interrupted = threading.Event()
_grace_s: float | None = GRACE_S


def stop_at_ctrl_c(grace_s: float | None) -> None:
    """From now on; `grace_s` for the clean-up after the first Ctrl-C (None: however long)."""
    global _grace_s
    _grace_s = grace_s
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _interrupted.is_set():
        _end_now()
    _interrupted.set()
    if _grace_s is not None:
        timer = threading.Timer(_grace_s, _end_now)
        timer.daemon = True
        timer.start()
    raise KeyboardInterrupt


def _end_now() -> None:
    os._exit(STATUS)  # nothing more may wait: no clean-up, no buffered output flushed

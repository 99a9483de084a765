"""Ctrl-C stops every command of the API at once (the platform's services stop on their own
signals, draining what they serve; commands on this host keep Python's own handling).

The first SIGINT raises KeyboardInterrupt where the command is, so its own handling and clean-up
run (a follower says what it left running, a terminal is restored, connections close); the
command then ends with status 130, as shells expect of an interrupted program. Its clean-up may
wait on something that does not answer (an API frozen mid-call): it gets GRACE_S. A second
Ctrl-C ends the process at once.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

GRACE_S = 2  # seconds
STATUS = 128 + signal.SIGINT

_interrupted = threading.Event()


def stop_at_ctrl_c() -> None:
    signal.signal(signal.SIGINT, _on_sigint)


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _interrupted.is_set():
        _end_now()
    _interrupted.set()
    timer = threading.Timer(GRACE_S, _end_now)
    timer.daemon = True
    timer.start()
    raise KeyboardInterrupt


def _end_now() -> None:
    os._exit(STATUS)  # nothing more may wait: no clean-up, no buffered output flushed

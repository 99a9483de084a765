"""The worker's fence against controllers that lost their leadership.

Every lifecycle call carries the caller's leader epoch. The worker keeps the newest epoch it
has seen (on disk, flushed before it acts on it, so a restart forgets nothing) and refuses older
ones: a leader that froze and was replaced cannot act here once its successor has been heard.
"""

from __future__ import annotations

import threading
from pathlib import Path

from space.worker.sandboxes.records import write_durable


class StaleEpoch(Exception):
    def __init__(self, epoch: int, newest: int) -> None:
        super().__init__(
            f"leader epoch {epoch} is stale: this worker has heard from epoch {newest}"
        )
        self.epoch = epoch
        self.newest = newest


class Fence:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self.epoch = int(path.read_text().strip() or 0)
        except (OSError, ValueError):
            self.epoch = 0

    def check(self, epoch: int) -> None:
        """Refuse an epoch older than the newest seen; remember a newer one first."""
        with self._lock:
            if epoch < self.epoch:
                raise StaleEpoch(epoch, self.epoch)
            if epoch > self.epoch:
                write_durable(self.path, str(epoch))
                self.epoch = epoch

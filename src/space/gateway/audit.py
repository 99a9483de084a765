"""Every gateway decision: in memory, a ring per sandbox (read through the control API), so one
sandbox's flood of events never pushes out another's; on disk, a JSON-lines file rotated by
size."""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True, slots=True)
class AuditEvent:
    seq: int
    time: float
    sandbox: str | None
    kind: str  # dns | tcp | tls | http | https | policy
    decision: str  # allow | deny
    reason: str
    host: str | None = None
    port: int | None = None
    address: str | None = None  # what was dialled (allow) or what the guest asked for (deny)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Ring:
    events: collections.deque[AuditEvent]
    dropped: int = 0  # pushed out by newer events of the same sandbox


@dataclass
class Limits:
    ring: int = 1000  # events kept per sandbox
    rings: int = 256  # sandboxes kept (the longest quiet let go first)
    file_bytes: int = 64 << 20  # the file is rotated past this
    files: int = 5  # rotated files kept: audit.jsonl.1 (newest) … audit.jsonl.N


class _File:
    """The JSON-lines file. Its directory is held open, so that rotating (renames, a new
    file) works once the gateway has dropped root, whatever the path above it allows."""

    def __init__(self, path: Path, limits: Limits) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.name, self.limits = path.name, limits
        self._dir = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        self.out = self._open()
        self.size = self.out.tell()

    def _open(self) -> IO[str]:
        fd = os.open(self.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644, dir_fd=self._dir)
        return os.fdopen(fd, "a", buffering=1)

    def write(self, line: str) -> None:
        if self.size + len(line) > self.limits.file_bytes and self.size:
            self._rotate()
        self.out.write(line)
        self.size += len(line)

    def _rotate(self) -> None:
        try:
            for i in range(self.limits.files - 1, 0, -1):
                with contextlib.suppress(FileNotFoundError):
                    self._rename(f"{self.name}.{i}", f"{self.name}.{i + 1}")
            self._rename(self.name, f"{self.name}.1")
            out = self._open()
        except OSError as e:  # keep logging to the file it has rather than lose events
            print(f"space-gateway: audit file not rotated: {e}", file=sys.stderr)
            return
        self.out.close()
        self.out, self.size = out, 0

    def _rename(self, old: str, new: str) -> None:
        os.replace(old, new, src_dir_fd=self._dir, dst_dir_fd=self._dir)

    def close(self) -> None:
        self.out.close()
        os.close(self._dir)


class AuditLog:
    def __init__(self, path: Path, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self._rings: collections.OrderedDict[str | None, _Ring] = collections.OrderedDict()
        self.rings_dropped = 0  # sandboxes whose whole trail was let go
        self._seq = 0
        self.directory = path.parent  # the gateway must be able to write here, to rotate
        self._file: _File | None = _File(path, self.limits)

    def record(
        self,
        sandbox: str | None,
        kind: str,
        decision: str,
        reason: str,
        host: str | None = None,
        port: int | None = None,
        address: str | None = None,
    ) -> AuditEvent:
        self._seq += 1
        event = AuditEvent(
            self._seq, time.time(), sandbox, kind, decision, reason, host, port, address
        )
        ring = self._rings.get(sandbox)
        if ring is None:
            ring = self._rings[sandbox] = _Ring(collections.deque(maxlen=self.limits.ring))
            if len(self._rings) > self.limits.rings:
                self._rings.popitem(last=False)
                self.rings_dropped += 1
        else:
            self._rings.move_to_end(sandbox)
        if len(ring.events) == self.limits.ring:
            ring.dropped += 1
        ring.events.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event.to_json()) + "\n")
        return event

    def events(
        self, sandbox: str | None = None, after: int = 0, limit: int = 1000
    ) -> list[AuditEvent]:
        """Events after number `after`, oldest first: one sandbox's, or (None) everyone's."""
        if sandbox is None:
            rings = list(self._rings.values())
        else:
            rings = [r] if (r := self._rings.get(sandbox)) is not None else []
        merged = heapq.merge(*(r.events for r in rings), key=lambda e: e.seq)
        return list(itertools.islice((e for e in merged if e.seq > after), limit))

    def dropped(self, sandbox: str | None = None) -> int:
        """Events no longer in memory (still in the file): one sandbox's, or everyone's."""
        if sandbox is not None:
            ring = self._rings.get(sandbox)
            return 0 if ring is None else ring.dropped
        return sum(r.dropped for r in self._rings.values())

    def stats(self) -> dict[str, int]:
        return {"rings": len(self._rings), "rings_dropped": self.rings_dropped,
                "events_dropped": self.dropped()}  # fmt: skip

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

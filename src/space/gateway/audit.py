"""Every gateway decision: an in-memory ring (read through the control API) and a JSON-lines
file."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any


@dataclass(frozen=True)
class AuditEvent:
    seq: int
    time: float
    sandbox: str | None
    kind: str  # dns | tcp | tls | http
    decision: str  # allow | deny
    reason: str
    host: str | None = None
    port: int | None = None
    address: str | None = None  # what was dialled (allow) or what the guest asked for (deny)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class AuditLog:
    def __init__(self, path: Path | None, size: int = 10_000) -> None:
        self._ring: collections.deque[AuditEvent] = collections.deque(maxlen=size)
        self._seq = 0
        self._file: IO[str] | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)

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
        self._ring.append(event)
        if self._file is not None:
            self._file.write(json.dumps(event.to_json()) + "\n")
        return event

    def events(
        self, sandbox: str | None = None, after: int = 0, limit: int = 1000
    ) -> list[AuditEvent]:
        out = [e for e in self._ring if e.seq > after and (sandbox is None or e.sandbox == sandbox)]
        return out[:limit]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

"""What the doctor says about one need of SPACE: a `Check`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

# ok: as SPACE wants it; warn: SPACE works, degraded (slower, or without a feature);
# fail: SPACE cannot work on this host until it is fixed.
Status = Literal["ok", "warn", "fail"]
STATUSES: tuple[Status, ...] = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Check:
    id: str  # stable: "kvm", "tun", "disk.pool", ...
    status: Status
    summary: str  # one line: what was found
    detail: str = ""  # what it means for SPACE
    fix: str = ""  # the Debian package or the command that fixes it; empty when nothing to fix

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def worst(checks: list[Check]) -> Status:
    return max((c.status for c in checks), key=STATUSES.index, default="ok")

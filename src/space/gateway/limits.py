"""What keeps one sandbox from starving the others on its worker: connection caps (its own, the
gateway's, and a share once the gateway is busy), the descriptors those caps need, and a token
bucket for rates (DNS)."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

# Descriptors beyond two per connection (the guest's, the origin's): listening and control
# sockets, upstream DNS queries, the audit file, TLS scratch files.
RESERVED_FDS = 1024


class Caps:
    """`per_sandbox` open connections for one sandbox, `total` for the gateway; past three
    quarters of `total`, a sandbox already holding its share (`total` over the sandboxes with
    connections, plus one for a newcomer) gets no more, so the last quarter stays for the rest."""

    def __init__(self, per_sandbox: int, total: int) -> None:
        if not 0 < per_sandbox <= total // 2:
            raise ValueError(f"per-sandbox cap {per_sandbox} must be at most half of {total}")
        self.per_sandbox, self.total = per_sandbox, total
        self.busy = total * 3 // 4

    def refusal(self, held: int, open_now: int, active: Callable[[], int]) -> str | None:
        """Why a sandbox holding `held` connections gets no new one, or None."""
        if held >= self.per_sandbox:
            return f"more than {self.per_sandbox} open connections"
        if open_now >= self.total:
            return f"the gateway holds {self.total} connections, its limit"
        if open_now >= self.busy and held >= (share := self.total // (active() + 1)):
            return f"the gateway is busy and this sandbox holds its share ({share} connections)"
        return None


def fds_needed(total: int) -> int:
    return 2 * total + RESERVED_FDS


def raise_nofile(needed: int) -> int:
    """RLIMIT_NOFILE raised to `needed` (its hard limit too, where privileged); the soft limit
    now in force, which may stay lower (no privilege, or the kernel's fs.nr_open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    unlimited = hard == resource.RLIM_INFINITY
    for limits in ((needed, hard if unlimited else max(hard, needed)), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, limits)
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class TokenBucket:
    """`rate` a second on average, up to `burst` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self._at) * self.rate)
        self._at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    @property
    def full(self) -> bool:
        return self.tokens >= self.burst - 1


class Burst:
    """A run of refusals, audited once: `first()` is True for the run's first refusal only;
    `end()` when the sandbox is back under its limit."""

    def __init__(self) -> None:
        self.on = False
        self.refused = 0  # over the gateway's life

    def first(self) -> bool:
        self.refused += 1
        first, self.on = not self.on, True
        return first

    def end(self) -> None:
        self.on = False

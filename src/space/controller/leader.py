"""Leader election: a lease row in PostgreSQL, renewed within a deadline, with an epoch that
fences a leader who lost it.

A replica leads while it holds an unexpired lease. It renews every third of the lease's time to
live; a renewal that fails or does not finish in time makes it stop acting once it can no longer
prove it still holds the lease, before any other replica can take it. A leader that freezes
(SIGSTOP, a stalled host) simply stops renewing: its lease expires and a standby takes it with
the next epoch. Every call the leader makes to a worker carries its epoch, and every state
change it writes is fenced by it, so when a frozen leader wakes up its work in flight is
refused by the workers (which heard the new epoch from the new leader's first probe) and by the
database.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

from space.db.store import Store

log = logging.getLogger(__name__)


class LostLeadership(Exception):
    """This replica no longer leads: everything it does must stop."""


class Leadership:
    def __init__(self, store: Store, ttl_s: float, holder: str | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.holder = holder or f"{os.uname().nodename}-{os.getpid()}-{secrets.token_hex(3)}"
        self.epoch = 0
        self._renewed_at = 0.0  # monotonic time the lease was last taken or renewed (asked at)

    @property
    def every_s(self) -> float:
        return max(0.2, self.ttl_s / 3)

    def valid(self) -> bool:
        """Whether this replica can still be sure it leads (its last renewal is recent)."""
        return self.epoch > 0 and time.monotonic() - self._renewed_at < self.ttl_s * 0.8

    def check(self) -> int:
        """The epoch to act with; LostLeadership if this replica can no longer be sure."""
        if not self.valid():
            raise LostLeadership(f"the lease of epoch {self.epoch} may have expired")
        return self.epoch

    async def acquire(self) -> None:
        """Until this replica leads."""
        announced = False
        while True:
            asked_at = time.monotonic()
            try:
                epoch = await asyncio.wait_for(
                    self.store.take_lease(self.holder, self.ttl_s), self.every_s
                )
            except Exception as e:  # the database may be down or slow: keep asking
                log.warning("cannot reach the database for leader election: %s", e)
                epoch = None
            if epoch is not None:
                self.epoch, self._renewed_at = epoch, asked_at
                log.info("this controller leads (epoch %d)", epoch)
                return
            if not announced:
                log.info("another controller leads; standing by")
                announced = True
            await asyncio.sleep(self.every_s)

    async def hold(self) -> None:
        """Renew the lease until it is lost; returns (or raises) when this replica must stop."""
        while True:
            await asyncio.sleep(self.every_s)
            asked_at = time.monotonic()
            try:
                held = await asyncio.wait_for(
                    self.store.renew_lease(self.holder, self.epoch, self.ttl_s), self.every_s
                )
            except Exception as e:
                log.warning("lease renewal failed: %s", e)
                held = None
            if held:
                self._renewed_at = asked_at
            elif held is False:
                log.warning("the lease of epoch %d was taken over", self.epoch)
                return
            if not self.valid():
                log.warning("the lease of epoch %d could not be renewed in time", self.epoch)
                return

    async def release(self) -> None:
        if self.epoch:
            try:
                await asyncio.wait_for(self.store.release_lease(self.holder, self.epoch), 2)
            except Exception as e:
                log.info("lease not released (it will expire): %s", e)
        self.epoch = 0

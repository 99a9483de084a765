"""Leader election: a PostgreSQL session advisory lock held on a connection of its own.

Only the replica holding the lock acts. If the leader dies, its connection closes and the lock
is free at once; if the leader loses its connection, it stops acting before anyone else can
take over (the lock goes with the connection).
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg

from space.db.listen import raw_connect

log = logging.getLogger(__name__)

LOCK_KEY = 0x5350_4143_4C44  # "SPACLD"
CHECK_S = 1.0


class Leadership:
    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: asyncpg.Connection | None = None

    async def acquire(self) -> None:
        """Until this replica leads."""
        announced = False
        while True:
            try:
                conn = await raw_connect(self.url)
            except (OSError, asyncpg.PostgresError) as e:
                log.warning("cannot reach the database for leader election: %s", e)
                await asyncio.sleep(CHECK_S)
                continue
            if await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY):
                self._conn = conn
                log.info("this controller leads")
                return
            await conn.close()
            if not announced:
                log.info("another controller leads; standing by")
                announced = True
            await asyncio.sleep(CHECK_S)

    async def lost(self) -> None:
        """Returns when leadership is lost (the lock's connection broke)."""
        while True:
            await asyncio.sleep(CHECK_S)
            conn = self._conn
            if conn is None or conn.is_closed():
                return
            try:
                await asyncio.wait_for(conn.fetchval("SELECT 1"), CHECK_S * 3)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                return

    async def release(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None

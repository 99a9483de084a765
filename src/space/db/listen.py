"""Wake-ups from PostgreSQL: LISTEN on the sandbox channel, fan out to waiters.

Notifications only say "look again"; every waiter re-reads the database, and also looks again
every few seconds on its own, so a lost notification (a dropped connection) costs latency, never
correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

import asyncpg
from sqlalchemy.engine import make_url

from space.db.store import CHANNEL
from space.db.store.base import SERVER_SETTINGS

log = logging.getLogger(__name__)


async def raw_connect(url: str) -> asyncpg.Connection:
    u = make_url(url)
    return await asyncpg.connect(
        user=u.username,
        password=u.password,
        database=u.database,
        host=u.query.get("host") or u.host,
        port=u.port,
        timeout=10,
        command_timeout=30,
        server_settings=SERVER_SETTINGS,
    )


class Listener:
    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: asyncpg.Connection | None = None
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._any: set[asyncio.Event] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._connect()
        self._task = asyncio.ensure_future(self._keepalive())

    async def _connect(self) -> None:
        conn = await raw_connect(self.url)
        await conn.add_listener(CHANNEL, self._on_notify)
        self._conn = conn

    async def _alive(self) -> bool:
        """The connection answers (a half-open one would take notifications to the grave)."""
        if self._conn is None or self._conn.is_closed():
            return False
        try:
            await asyncio.wait_for(self._conn.fetchval("SELECT 1"), 3)
            return True
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            self._conn.terminate()
            return False

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(2)
            if not await self._alive():
                try:
                    await self._connect()
                    self._wake_all()  # anything may have happened meanwhile
                except (OSError, asyncpg.PostgresError, TimeoutError) as e:
                    log.warning("LISTEN connection: %s", e)

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        for ev in self._waiters.get(payload, ()):
            ev.set()
        for ev in self._any:
            ev.set()

    def _wake_all(self) -> None:
        for evs in self._waiters.values():
            for ev in evs:
                ev.set()
        for ev in self._any:
            ev.set()

    def subscribe(self, sandbox_id: str | None = None) -> asyncio.Event:
        ev = asyncio.Event()
        (self._waiters[sandbox_id] if sandbox_id else self._any).add(ev)
        return ev

    def unsubscribe(self, ev: asyncio.Event, sandbox_id: str | None = None) -> None:
        if sandbox_id:
            self._waiters[sandbox_id].discard(ev)
            if not self._waiters[sandbox_id]:
                del self._waiters[sandbox_id]
        else:
            self._any.discard(ev)

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._conn is not None:
            await self._conn.close()

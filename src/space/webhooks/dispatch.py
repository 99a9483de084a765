"""The leader's webhook loop: queue what the sandboxes' events owe each endpoint, then send.

Sending never holds anything a sandbox needs: each delivery is a task of its own with a deadline
(`SEND_S`), at most `AT_ONCE` in flight and one per endpoint (so an endpoint gets its events in
order, but for those tried again): a slow or dead endpoint delays only its own deliveries. A
delivery answered 2xx is done; any other answer, no answer or a refused target is tried again
after 2, 4, 8 ... s (at most an hour apart) until a day has passed since it was queued; every
try is recorded with its status or error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import httpx
import sqlalchemy as sa

from space import __version__
from space.db.sealing import Sealer
from space.db.store import Store
from space.db.store.webhooks import Due
from space.gateway.policy import EgressFloor
from space.webhooks import signing
from space.webhooks.events import event_types, payload
from space.webhooks.targets import Target, TargetRefused, resolve

log = logging.getLogger(__name__)

SEND_S = 10.0  # one attempt, connection to answer
AT_ONCE = 64
PER_TENANT = 8  # of those, at most this many to one tenant's endpoints
RESOLVERS = 4
GIVE_UP_AFTER = timedelta(days=1)
MAX_BACKOFF_S = 3600.0
KEEP_ERROR = 500  # characters of an attempt's error kept


def plan(events: list[sa.RowMapping], hooks: list[sa.RowMapping]) -> Iterable[Mapping[str, Any]]:
    """The deliveries `events` owe the endpoints `hooks` (of the events' tenants)."""
    for event in events:
        for event_type in event_types(event["type"], event["from_state"], event["to_state"],
                                      event["reason"]):  # fmt: skip
            body = payload(event_type, event)
            for hook in hooks:
                if (hook["tenant_id"] == event["tenant_id"] and event_type in hook["events"]
                        and event["id"] > hook["after_event"]):  # fmt: skip
                    yield {"webhook_id": hook["id"], "event_id": event["id"],
                           "type": event_type, "payload": body}  # fmt: skip


class Webhooks:
    def __init__(self, store: Store, sealer: Sealer, floor: EgressFloor) -> None:
        self.store = store
        self.sealer = sealer
        self.floor = floor
        self._sending: dict[str, asyncio.Task[None]] = {}  # by endpoint
        self._per_tenant: Counter[str] = Counter()
        # Names are resolved on threads of their own: a slow DNS server holds only these.
        self._resolving = ThreadPoolExecutor(RESOLVERS, thread_name_prefix="webhook-dns")
        self._http = httpx.AsyncClient(
            timeout=SEND_S, follow_redirects=False, trust_env=False,
            headers={"User-Agent": f"space-webhooks/{__version__}", "Accept-Encoding": "identity"},
        )  # fmt: skip

    async def once(self) -> None:
        await self.store.queue_deliveries(plan)
        room = AT_ONCE - len(self._sending)
        if room <= 0:
            return
        for due in await self.store.due_deliveries(room, set(self._sending), self.sealer):
            if self._per_tenant[due.tenant_id] >= PER_TENANT:
                continue  # one tenant's endpoints never take every slot
            self._per_tenant[due.tenant_id] += 1
            task = asyncio.ensure_future(self._deliver(due))
            self._sending[due.webhook_id] = task
            task.add_done_callback(partial(self._sent, due))

    def _sent(self, due: Due, _: asyncio.Task[None]) -> None:
        self._sending.pop(due.webhook_id, None)
        self._per_tenant[due.tenant_id] -= 1

    async def close(self) -> None:
        for task in list(self._sending.values()):
            task.cancel()
        await asyncio.gather(*self._sending.values(), return_exceptions=True)
        await self._http.aclose()
        self._resolving.shutdown(wait=False, cancel_futures=True)

    async def _deliver(self, due: Due) -> None:
        started = time.perf_counter()
        status, error = await self._send(due)
        ms = (time.perf_counter() - started) * 1000
        now = datetime.now(UTC)
        if status is not None and 200 <= status < 300:
            state, next_at = "delivered", None
        elif now - due.created_at >= GIVE_UP_AFTER:
            state, next_at = "failed", None
            log.warning("webhook %s: gave up delivery %d after a day: %s", due.webhook_id,
                        due.id, error or status)  # fmt: skip
        else:
            state = "pending"
            next_at = now + timedelta(seconds=min(2.0 ** (due.attempts + 1), MAX_BACKOFF_S))
        try:
            await self.store.record_attempt(due, status, error, ms, state, next_at)
        except Exception:  # tried again at the next pass: a receiver must take duplicates
            log.exception("webhook %s: delivery %d not recorded", due.webhook_id, due.id)

    async def _send(self, due: Due) -> tuple[int | None, str | None]:
        """The endpoint's status, or why there is none."""
        body = json.dumps(due.payload, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            signing.HEADER: signing.sign(due.secret, body),
            "Space-Webhook-Id": due.webhook_id,
            "Space-Delivery-Id": str(due.id),
            "Space-Event": due.type,
        }
        try:
            target = await resolve(due.url, self.floor, self._resolving)
            headers["Host"] = target.netloc
            return await asyncio.wait_for(self._status(target, body, headers), SEND_S), None
        except TargetRefused as e:
            return None, f"refused: {e}"[:KEEP_ERROR]
        except Exception as e:  # whatever its endpoint or URL does: an attempt that failed
            return None, (f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)[:KEEP_ERROR]

    async def _status(self, target: Target, body: bytes, headers: dict[str, str]) -> int:
        """Only the answer's status: its body is never read (an endpoint may send gigabytes,
        or a few bytes that unpack to them)."""
        request = self._http.build_request("POST", target.url, content=body, headers=headers,
                                           extensions={"sni_hostname": target.host})  # fmt: skip
        response = await self._http.send(request, stream=True)
        await response.aclose()
        return response.status_code

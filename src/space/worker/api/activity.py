"""When each VM was last used: exec, process, file and ingress calls (and its making, claim and
resume), counted as they begin and end, so a stream held open keeps its VM busy. The controller
pauses a sandbox whose idle time passes its idle timeout; the worker's own calls (health,
stats, audit, network, pause) are not use, and neither is a file watch held open (it only
listens: what changes the files is use of its own). An ingress connection counts itself
(`tcp.Use`): it is use while open, except while the API keeps it idle for a next request.
"""

from __future__ import annotations

import re
import time
from collections import Counter

from starlette.types import ASGIApp, Receive, Scope, Send

USE = re.compile(
    r"^/vms/(?P<id>[A-Za-z0-9_-]{1,64})(?P<what>/exec(?:/ws)?|/files(?:/(?!watch)\w+)?"
    r"|/processes(?:/[^/]+(?:/\w+)?)?|/claim|/resume|)$"
)


class Activity:
    def __init__(self) -> None:
        self._open: Counter[str] = Counter()
        self._last: dict[str, float] = {}

    def begin(self, vm_id: str) -> None:
        self._open[vm_id] += 1
        self._last[vm_id] = time.monotonic()

    def end(self, vm_id: str) -> None:
        self._open[vm_id] -= 1
        if self._open[vm_id] <= 0:
            del self._open[vm_id]
        self._last[vm_id] = time.monotonic()

    def idle_s(self, vm_id: str) -> float:
        """Seconds since the VM was last used; 0 while a call on it is open. A VM never seen
        (made before this worker process started) counts from when it is first asked about."""
        if self._open[vm_id] > 0:
            return 0.0
        now = time.monotonic()
        return now - self._last.setdefault(vm_id, now)

    def forget(self, keep: set[str]) -> None:
        for vm_id in set(self._last) - keep:
            self._last.pop(vm_id, None)


class ActivityMiddleware:
    def __init__(self, app: ASGIApp, activity: Activity) -> None:
        self.app = app
        self.activity = activity

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = USE.match(scope.get("path", "")) if scope["type"] in ("http", "websocket") else None
        if match is None or (match["what"] == "" and scope.get("method") != "PUT"):
            await self.app(scope, receive, send)
            return
        vm_id = match["id"]
        self.activity.begin(vm_id)
        try:
            await self.app(scope, receive, send)
        finally:
            self.activity.end(vm_id)

"""A worker announcing itself to the control plane, and both sides' terms for it.

A worker holds no database credentials: it registers at the API, which calls it back at the
address it gives (under mutual TLS, a caller's check of the worker's certificate proves its id)
and records what it answers there. Now and then the worker asks whether it is still the process
registered under its id; once another has registered, it stops. Its liveness is the controller's
probes', not these calls'.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
from pydantic import BaseModel, Field

from space.release import HEADER as RELEASE_HEADER
from space.release import VERSION

log = logging.getLogger(__name__)

INSTANCE = r"^[0-9a-f]{8,64}$"
REGISTER_S = 15.0  # the API calls the worker back within its own, shorter deadline
HEARTBEAT_S = 2.0
RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class Registration(BaseModel):
    url: str = Field(
        max_length=2000, pattern=r"^https?://", description="where the control plane reaches it"
    )
    instance: str = Field(pattern=INSTANCE, description="this process, among all of its id's")


class Heartbeat(BaseModel):
    instance: str = Field(pattern=INSTANCE)


class Refused(Exception):
    """The API refused the registration for a reason another try would meet again."""


class ControlPlane:
    """The worker's client of the API, for its own registration."""

    def __init__(self, url: str, secret: str, worker_id: str, instance: str) -> None:
        self.instance = instance
        self._base = f"{url.rstrip('/')}/v1/workers/{worker_id}"
        self._http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {secret}", RELEASE_HEADER: VERSION},
            timeout=REGISTER_S,
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def run(self, url: str) -> None:
        """Register, then keep asking; returns once another process has registered."""
        await self.register(url)
        await self.heartbeats(url)

    async def register(self, url: str) -> None:
        """Until the API has it registered (the API may be starting, or away for a moment)."""
        body = Registration(url=url, instance=self.instance).model_dump()
        tries = 0
        while True:
            try:
                r = await self._http.post(f"{self._base}/register", json=body)
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200:
                    log.info("registered at %s as %s", self._base, url)
                    return
                why = f"{r.status_code}: {_detail(r)}"
                if r.status_code in (400, 401, 403, 404, 422, 426):
                    raise Refused(f"the API refused this worker's registration ({why})")
            delay = RETRY_S[min(tries, len(RETRY_S) - 1)]
            tries += 1
            log.warning("not registered yet (%s); trying again in %g s", why, delay)
            await asyncio.sleep(delay)

    async def heartbeats(self, url: str) -> None:
        """Returns once another process has registered under this id; an API that does not
        answer stops nothing. A database restored from a backup names an earlier process of
        this worker: this one registers again, which the API allows only when no other
        process of the id answers."""
        body = Heartbeat(instance=self.instance).model_dump()
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                r = await self._http.post(f"{self._base}/heartbeat", json=body)
            except httpx.HTTPError as e:
                log.warning("heartbeat not answered: %s", e)
                continue
            if r.status_code == 409:
                try:
                    again = await self._http.post(
                        f"{self._base}/register",
                        json=Registration(url=url, instance=self.instance).model_dump(),
                    )
                except httpx.HTTPError as e:
                    log.warning("registering again not answered: %s", e)
                    continue
                if again.status_code == 200:
                    log.warning("the API knew an earlier process of this worker: registered again")
                    continue
                if again.status_code != 409:  # the API away for a moment: the next beat asks
                    log.warning("registering again refused (%s: %s)", again.status_code,
                                _detail(again))  # fmt: skip
                    continue
                log.error("another process registered as this worker (%s); stopping",
                          _detail(again))  # fmt: skip
                return
            if r.status_code != 204:
                log.warning("heartbeat refused (%s: %s)", r.status_code, _detail(r))


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))[:500]
    except ValueError:
        return r.text[:500]

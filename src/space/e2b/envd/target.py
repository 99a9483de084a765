"""Who an envd call is for and where it goes: the sandbox its `E2b-Sandbox-Id` names, opened by
the access token of its `X-Access-Token`, on the worker that runs it; the user of its Basic
`Authorization` (E2B's way of naming one), and paths as that user's shell would read them.
SPACE's errors become the Connect codes the SDKs turn into their exceptions."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import posixpath
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from protobuf import Oneof

from space.api.data import target as running
from space.api.deps import Services
from space.api.errors import APIError
from space.api.limits import TooLarge
from space.db.store import Conflict, NotFound, Refused
from space.e2b import tokens
from space.worker.api.client import Worker, WorkerError

log = logging.getLogger(__name__)

ROOT = "root"
USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
KEEPALIVE_S = 50.0  # what the SDKs ask for; a proxy between may cut a quiet stream sooner

T = TypeVar("T")

CODES = {400: Code.INVALID_ARGUMENT, 401: Code.UNAUTHENTICATED, 403: Code.PERMISSION_DENIED,
         404: Code.NOT_FOUND, 409: Code.ALREADY_EXISTS, 413: Code.RESOURCE_EXHAUSTED,
         422: Code.INVALID_ARGUMENT, 429: Code.RESOURCE_EXHAUSTED, 504: Code.DEADLINE_EXCEEDED,
         507: Code.RESOURCE_EXHAUSTED}  # fmt: skip


@dataclass(frozen=True)
class Target:
    svc: Services
    tenant_id: str
    sandbox_id: str
    worker: Worker
    user: str | None  # None: the sandbox's default (root)

    @property
    def home(self) -> str:
        return "/root" if self.user in (None, ROOT) else f"/home/{self.user}"

    def path(self, path: str) -> str:
        """A path as E2B's daemon reads it: `~` and relative paths from the user's home."""
        if path == "~" or path.startswith("~/"):
            path = self.home + path[1:]
        return posixpath.normpath(posixpath.join(self.home, path)) if path else self.home


async def resolve(svc: Services, headers: Mapping[str, str]) -> Target:
    sandbox_id = headers.get("e2b-sandbox-id", "")
    if not sandbox_id:
        raise ConnectError(Code.INVALID_ARGUMENT, "no E2b-Sandbox-Id header: which sandbox?")
    with errors():
        tenant = await tokens.holder(svc, headers.get("x-access-token", ""), sandbox_id)
        worker = await running(svc, tenant.id, sandbox_id)
    return Target(svc, tenant.id, sandbox_id, worker, user_of(headers.get("authorization", "")))


def user_of(authorization: str) -> str | None:
    """The user of `Basic base64("name:")`; None when the call names none."""
    scheme, _, blob = authorization.partition(" ")
    if scheme.lower() != "basic" or not blob:
        return None
    try:
        name = base64.b64decode(blob, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError(Code.UNAUTHENTICATED, "Authorization is not Basic base64") from None
    if name and not USER.fullmatch(name):
        raise ConnectError(Code.UNAUTHENTICATED, f"{name!r} is not a user name")
    return name or None


def code_for(status: int) -> Code:
    return CODES.get(status, Code.UNAVAILABLE if status >= 500 else Code.INVALID_ARGUMENT)


@contextlib.contextmanager
def errors() -> Iterator[None]:
    """SPACE's refusals as Connect errors (what the SDKs map to their exceptions)."""
    try:
        yield
    except NotFound as e:
        # "was not found" is what tells an E2B SDK the sandbox is not running.
        raise ConnectError(Code.UNAVAILABLE, f"sandbox {e} was not found") from None
    except APIError as e:
        raise ConnectError(code_for(e.status), e.detail) from None
    except WorkerError as e:
        raise ConnectError(code_for(e.status), e.detail) from None
    except (Conflict, Refused) as e:
        raise ConnectError(Code.FAILED_PRECONDITION, str(e)) from None
    except TooLarge as e:
        raise ConnectError(Code.RESOURCE_EXHAUSTED, str(e.detail)) from None
    except ConnectError:
        raise
    except Exception:
        # Its text may say what is not the caller's to know: it is logged, not sent.
        log.exception("envd call failed")
        raise ConnectError(Code.INTERNAL, "internal error; it has been logged") from None


async def paced(events: AsyncIterator[T], interval: float) -> AsyncGenerator[T | None]:
    """The events, and None after each `interval` without one (for a keepalive), read by a
    task of its own so a quiet stream is never cancelled mid-read."""
    queue: asyncio.Queue[tuple[T | None, BaseException | None, bool]] = asyncio.Queue(64)

    async def pump() -> None:
        try:
            async for event in events:
                await queue.put((event, None, False))
            await queue.put((None, None, True))
        except Exception as e:  # handed to the reader, which raises it
            await queue.put((None, e, True))

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                event, error, done = await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                yield None
                continue
            if error is not None:
                raise error
            if done:
                return
            yield event
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def keepalive_s(headers: Mapping[str, str]) -> float:
    try:
        return min(max(float(headers.get("keepalive-ping-interval", KEEPALIVE_S)), 1.0), 300.0)
    except ValueError:
        return KEEPALIVE_S


def oneof(field: str, value: object) -> Any:
    """A member of a message's oneof (the message checks the field's name when it is sent)."""
    return Oneof(field, value)

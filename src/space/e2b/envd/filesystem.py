"""envd's Filesystem service on SPACE's file calls: stat, list (to a depth), make a directory,
move, remove, and watch, as a stream (the async SDK) or as a watcher polled for what happened
since the last poll (the sync SDK), kept here while it is polled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import posixpath
import secrets
import stat
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from space.api.deps import Services
from space.e2b.envd.target import Target, errors, keepalive_s, oneof, paced, resolve
from space.e2b.proto.filesystem.filesystem_connect import Filesystem
from space.e2b.proto.filesystem.filesystem_pb import (
    CreateWatcherRequest,
    CreateWatcherResponse,
    EntryInfo,
    EventType,
    FilesystemEvent,
    FileType,
    GetWatcherEventsRequest,
    GetWatcherEventsResponse,
    ListDirRequest,
    ListDirResponse,
    MakeDirRequest,
    MakeDirResponse,
    MoveRequest,
    MoveResponse,
    RemoveRequest,
    RemoveResponse,
    RemoveWatcherRequest,
    RemoveWatcherResponse,
    StatRequest,
    StatResponse,
    WatchDirRequest,
    WatchDirResponse,
)
from space.worker.api.client import WorkerError
from space.worker.api.models import FileEntry

log = logging.getLogger(__name__)

TYPES = {"file": FileType.FILE, "directory": FileType.DIRECTORY,
         "symlink": FileType.SYMLINK}  # fmt: skip
KINDS = {"create": EventType.CREATE, "write": EventType.WRITE,
         "remove": EventType.REMOVE, "rename": EventType.RENAME,
         "chmod": EventType.CHMOD}  # fmt: skip
MAX_LISTED = 10_000  # entries one ListDir answers, however deep
MAX_DEPTH = 32
WATCHERS_PER_SANDBOX = 16
WATCHERS_PER_TENANT = 64
WATCHER_EVENTS = 1024  # kept between two polls (at most 4 MiB of names); the oldest go first
MAX_NAME = 4096
WATCHER_IDLE_S = 600.0  # a watcher nobody polled for this long is stopped
MAX_EVENT_LINE = 1 << 20


def entry_of(f: FileEntry) -> EntryInfo:
    kind = "d" if f.type == "directory" else "l" if f.type == "symlink" else "-"
    entry = EntryInfo(
        name=f.name, type=TYPES.get(f.type, FileType.UNSPECIFIED), path=f.path,
        size=f.size, mode=f.mode, permissions=kind + stat.filemode(f.mode)[1:],
        owner="root" if f.uid == 0 else str(f.uid), group="root" if f.gid == 0 else str(f.gid),
        modified_time=Timestamp.from_datetime(_when(f.mtime)),
        is_symlink=f.type == "symlink",
    )  # fmt: skip
    if f.target is not None:
        entry.symlink_target = f.target
    return entry


def _when(mtime: float) -> datetime:
    """A file's mtime, as far as a timestamp goes (a guest can set any)."""
    try:
        return datetime.fromtimestamp(mtime, UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.max.replace(tzinfo=UTC) if mtime > 0 else datetime.min.replace(tzinfo=UTC)


async def watch_events(
    t: Target, path: str, recursive: bool
) -> AsyncGenerator[FilesystemEvent | None]:
    """None once the watch is set (its errors come before), then what changes under `path`,
    named relative to it as the SDKs want."""
    with errors():
        async with t.svc.workers.watch(t.worker, t.sandbox_id, path, recursive) as resp:
            yield None
            async for line in resp.aiter_lines():
                if len(line) > MAX_EVENT_LINE:
                    raise ConnectError(Code.INTERNAL, "a watch event is too large")
                event = json.loads(line) if line else {}
                kind = KINDS.get(str(event.get("type", "")))
                changed = event.get("path")
                if kind is not None and isinstance(changed, str) and len(changed) <= MAX_NAME:
                    yield FilesystemEvent(name=posixpath.relpath(changed, path), type=kind)


@dataclass
class Watcher:
    owner: tuple[str, str]  # the tenant and the sandbox: nobody else polls it
    task: asyncio.Task[None] | None = None
    events: deque[FilesystemEvent] = field(default_factory=lambda: deque(maxlen=WATCHER_EVENTS))
    error: ConnectError | None = None
    polled: float = field(default_factory=time.monotonic)


class FilesystemService(Filesystem):
    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services
        self.watchers: dict[str, Watcher] = {}

    async def _target(self, ctx: RequestContext[Any, Any]) -> Target:
        return await resolve(self.services(), ctx.request_headers)

    async def stat(
        self, request: StatRequest, ctx: RequestContext[StatRequest, StatResponse]
    ) -> StatResponse:
        t = await self._target(ctx)
        with errors():
            found = await t.svc.workers.stat(t.worker, t.sandbox_id, t.path(request.path))
        return StatResponse(entry=entry_of(found))

    async def list_dir(
        self, request: ListDirRequest, ctx: RequestContext[ListDirRequest, ListDirResponse]
    ) -> ListDirResponse:
        t = await self._target(ctx)
        depth = min(max(request.depth, 1), MAX_DEPTH)
        entries: list[EntryInfo] = []
        level = [t.path(request.path)]
        with errors():
            for _ in range(depth):
                below = []
                for directory in level:
                    listed = await t.svc.workers.list_dir(t.worker, t.sandbox_id, directory)
                    for f in listed.entries:
                        if len(entries) == MAX_LISTED:
                            too_many = f"more than {MAX_LISTED} entries: list less deep"
                            raise ConnectError(Code.RESOURCE_EXHAUSTED, too_many)
                        entries.append(entry_of(f))
                        if f.type == "directory":
                            below.append(f.path)
                level = below
        return ListDirResponse(entries=entries)

    async def make_dir(
        self, request: MakeDirRequest, ctx: RequestContext[MakeDirRequest, MakeDirResponse]
    ) -> MakeDirResponse:
        t = await self._target(ctx)
        path = t.path(request.path)
        with errors():
            try:
                found: FileEntry | None = await t.svc.workers.stat(t.worker, t.sandbox_id, path)
            except WorkerError as e:
                if e.status != 404:
                    raise
                found = None
            if found is not None:
                code = Code.ALREADY_EXISTS if found.type == "directory" else Code.INVALID_ARGUMENT
                raise ConnectError(code, f"{path} exists")
            made = await t.svc.workers.mkdir(t.worker, t.sandbox_id, path, parents=True)
        return MakeDirResponse(entry=entry_of(made))

    async def move(
        self, request: MoveRequest, ctx: RequestContext[MoveRequest, MoveResponse]
    ) -> MoveResponse:
        t = await self._target(ctx)
        with errors():
            source, destination = t.path(request.source), t.path(request.destination)
            moved = await t.svc.workers.rename(
                t.worker, t.sandbox_id, source, destination, overwrite=True
            )
        return MoveResponse(entry=entry_of(moved))

    async def remove(
        self, request: RemoveRequest, ctx: RequestContext[RemoveRequest, RemoveResponse]
    ) -> RemoveResponse:
        t = await self._target(ctx)
        with errors():
            await t.svc.workers.remove(t.worker, t.sandbox_id, t.path(request.path), recursive=True)
        return RemoveResponse()

    async def watch_dir(
        self, request: WatchDirRequest, ctx: RequestContext[WatchDirRequest, WatchDirResponse]
    ) -> AsyncIterator[WatchDirResponse]:
        t = await self._target(ctx)
        events = watch_events(t, t.path(request.path), request.recursive)
        await anext(events)  # the watch is set, or its error is the call's
        yield WatchDirResponse(event=oneof("start", WatchDirResponse.StartEvent()))
        async with contextlib.aclosing(paced(events, keepalive_s(ctx.request_headers))) as paced_:
            async for ev in paced_:
                if ev is None:
                    yield WatchDirResponse(event=oneof("keepalive", WatchDirResponse.KeepAlive()))
                else:
                    yield WatchDirResponse(event=oneof("filesystem", ev))

    async def create_watcher(
        self,
        request: CreateWatcherRequest,
        ctx: RequestContext[CreateWatcherRequest, CreateWatcherResponse],
    ) -> CreateWatcherResponse:
        t = await self._target(ctx)
        self._sweep()
        owner = (t.tenant_id, t.sandbox_id)
        if sum(w.owner == owner for w in self.watchers.values()) >= WATCHERS_PER_SANDBOX:
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"at most {WATCHERS_PER_SANDBOX} watchers per sandbox")  # fmt: skip
        if sum(w.owner[0] == t.tenant_id for w in self.watchers.values()) >= WATCHERS_PER_TENANT:
            raise ConnectError(Code.RESOURCE_EXHAUSTED,
                               f"at most {WATCHERS_PER_TENANT} watchers per tenant")  # fmt: skip
        # Its place is taken before the watch is set, so creates at once cannot pass the caps.
        watcher, watcher_id = Watcher(owner), secrets.token_urlsafe(12)
        self.watchers[watcher_id] = watcher
        events = watch_events(t, t.path(request.path), request.recursive)
        try:
            await anext(events)
        except BaseException:
            del self.watchers[watcher_id]
            await events.aclose()
            raise
        watcher.task = asyncio.create_task(self._collect(watcher, events))
        return CreateWatcherResponse(watcher_id=watcher_id)

    @staticmethod
    async def _collect(watcher: Watcher, events: AsyncGenerator[FilesystemEvent | None]) -> None:
        try:
            async for ev in events:
                if ev is not None:
                    watcher.events.append(ev)
        except ConnectError as e:
            watcher.error = e
        except httpx.HTTPError as e:
            watcher.error = ConnectError(Code.UNAVAILABLE, f"the watch ended: {e}")
        except Exception:
            log.exception("a watcher's watch failed")
            watcher.error = ConnectError(Code.INTERNAL, "the watch failed; it has been logged")
        else:
            watcher.error = ConnectError(Code.UNAVAILABLE, "the watch ended")

    async def _watcher(self, ctx: RequestContext[Any, Any], watcher_id: str) -> Watcher:
        t = await self._target(ctx)
        self._sweep()
        watcher = self.watchers.get(watcher_id)
        if watcher is None or watcher.owner != (t.tenant_id, t.sandbox_id):
            raise ConnectError(Code.NOT_FOUND, f"no watcher {watcher_id!r}")
        watcher.polled = time.monotonic()
        return watcher

    async def get_watcher_events(
        self,
        request: GetWatcherEventsRequest,
        ctx: RequestContext[GetWatcherEventsRequest, GetWatcherEventsResponse],
    ) -> GetWatcherEventsResponse:
        watcher = await self._watcher(ctx, request.watcher_id)
        events = list(watcher.events)
        watcher.events.clear()
        if not events and watcher.error is not None:
            self._stop(request.watcher_id)
            raise watcher.error
        return GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self,
        request: RemoveWatcherRequest,
        ctx: RequestContext[RemoveWatcherRequest, RemoveWatcherResponse],
    ) -> RemoveWatcherResponse:
        await self._watcher(ctx, request.watcher_id)
        self._stop(request.watcher_id)
        return RemoveWatcherResponse()

    def _stop(self, watcher_id: str) -> None:
        watcher = self.watchers.pop(watcher_id, None)
        if watcher is not None and watcher.task is not None:
            watcher.task.cancel()

    def _sweep(self) -> None:
        """Watchers whose client went away without removing them stop after a while."""
        idle = time.monotonic() - WATCHER_IDLE_S
        for watcher_id in [k for k, w in self.watchers.items() if w.polled < idle]:
            self._stop(watcher_id)

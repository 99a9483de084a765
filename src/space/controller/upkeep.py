"""The periodic loops: sandbox timeouts, garbage collection, volume and template clean-up, and
template builds. Loops that call workers call them all at once, each call with its deadline, so
one slow worker holds up nobody else.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Awaitable, Callable, Iterable

from space.controller.leader import Leadership, LostLeadership
from space.controller.placement import Need, pick_worker, place
from space.db.sealing import Sealer, SealError
from space.db.store import Conflict, NotFound, Row, Store
from space.db.store.templates import build_context
from space.webhooks.events import TIMED_OUT
from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import AdoptVolume, BuildRequest, CheckpointSource

log = logging.getLogger(__name__)
VOLUMES_AT_ONCE = 4  # each push or pull holds a few chunks in memory on its worker

TIMEOUT_ACTIONS = {"pause": ("paused", "pause"), "suspend": ("suspended", "suspend"),
                   "delete": ("deleted", "delete")}  # fmt: skip
BUILD_NEED = Need(1, 512)  # what a build VM holds on its worker


async def timeouts(store: Store) -> None:
    """Sandboxes past their timeout are paused, suspended or deleted, as each asked."""
    for row in await store.expired():
        desired, verb = TIMEOUT_ACTIONS.get(row["timeout_action"], ("paused", "pause"))
        try:
            await store.request(
                row["tenant_id"], row["id"], desired, ("running",), verb,
                only_if_desired="running", reason=TIMED_OUT,
            )  # fmt: skip
            log.info("sandbox %s timed out: %s", row["id"], verb)
        except (Conflict, NotFound):
            pass  # it changed meanwhile


async def each_worker(workers: Iterable[Row], call: Callable[[Row], Awaitable[None]]) -> None:
    """`call(worker)` for every active worker at once; a stale epoch ends the leadership."""
    await _each([w for w in workers if w["state"] == "active"], call, "worker")


async def _each(
    rows: list[Row], call: Callable[[Row], Awaitable[None]], what: str, at_once: int = 0
) -> None:
    """`call(row)` for every row at once (at most `at_once` together, if given); a stale epoch
    ends the leadership, any other failure is logged and met again at the next pass."""
    slots = asyncio.Semaphore(at_once or max(len(rows), 1))

    async def one(row: Row) -> None:
        async with slots:
            await call(row)

    results = await asyncio.gather(*(one(r) for r in rows), return_exceptions=True)
    for row, result in zip(rows, results, strict=True):
        if isinstance(result, WorkerError) and result.status == 412:
            raise LostLeadership(result.detail)
        if isinstance(result, WorkerError):
            log.info("%s %s: %s", what, row["id"], result)
        elif isinstance(result, BaseException):
            log.warning("%s %s: %r", what, row["id"], result)


async def collect_garbage(store: Store, workers: WorkerClient) -> None:
    """Each live worker drops the VMs and snapshots the database no longer wants. A sandbox no
    row has ever named (the database was restored from a backup older than it) may hold a
    tenant's work: it is kept and reported as a stray until an operator discards it."""

    async def one(w: Row) -> None:
        worker = Worker(w["id"], w["url"])
        keep = {r["id"] for r in await store.on_worker(w["id"])}
        held = {vm.id for vm in (await workers.health(worker)).vms}
        strays = await store.unknown_sandboxes(held - keep)
        discarded = await store.found_strays(w["id"], strays)
        if strays - discarded:
            log.warning("worker %s holds sandboxes the database does not know, kept until an "
                        "operator decides (space admin strays): %s", w["id"],
                        sorted(strays - discarded))  # fmt: skip
        result = await workers.reconcile(worker, sorted(keep | (strays - discarded)))
        if result.removed:
            log.info("worker %s removed strays: %s", w["id"], result.removed)

    await each_worker(await store.workers(), one)


async def _remove_on_worker(
    store: Store, worker_id: str | None, remove: Callable[[Worker], Awaitable[None]]
) -> bool:
    """Remove something a worker holds (none: nothing to remove); False if that has to wait
    (the worker is away, or refused)."""
    worker = await store.worker(worker_id) if worker_id else None
    if worker is None:
        return True
    if worker["state"] != "active":
        return False  # the file is on that host: wait for the worker to come back
    try:
        await remove(Worker(worker["id"], worker["url"]))
    except WorkerError as e:
        if e.status == 412:
            raise LostLeadership(e.detail) from None
        log.info("not removed from worker %s yet: %s", worker["id"], e)
        return False
    return True


async def push_volumes(store: Store, workers: WorkerClient) -> None:
    """Volumes no sandbox has go to the registry from their worker, all at once, so that one
    whose host is lost or drained can move (`move_volumes`)."""

    async def push(vol: Row) -> None:
        worker = Worker(vol["worker_id"], vol["url"])
        pushed = await workers.push_volume(worker, vol["id"], vol["generation"])
        if await store.volume_pushed(vol, pushed.artifact):
            log.info("volume %s pushed: %s", vol["id"], pushed.artifact)

    await _each(await store.volumes_to_push(), push, "volume not pushed yet", VOLUMES_AT_ONCE)


async def move_volumes(store: Store, workers: WorkerClient) -> None:
    """A volume no sandbox has whose worker is lost or drained goes to another worker with a
    registry and room, which pulls its image first; only then does it live there."""
    candidates = [w for w in await store.workers()
                  if w["state"] == "active" and w["registry"] and not w["draining"]]  # fmt: skip
    load = dict(await store.worker_load())

    async def move(vol: Row) -> None:
        others = [w for w in candidates if w["id"] != vol["worker_id"]]
        # Counted where it goes: a drained host's volumes spread by the room left.
        target = place(others, load, Need(0, 0, vol["size_mib"]))
        if target is None:
            log.info("volume %s: no worker with a registry has room for it yet", vol["id"])
            return
        to = next(w for w in others if w["id"] == target)
        body = AdoptVolume(artifact=vol["artifact"], size_mib=vol["size_mib"])
        await workers.adopt_volume(Worker(to["id"], to["url"]), vol["id"], body)
        if await store.volume_moved(vol, target):
            log.info("volume %s moved from worker %s to %s", vol["id"], vol["worker_id"], target)

    await _each(await store.volumes_to_move(), move, "volume not moved yet", VOLUMES_AT_ONCE)


async def delete_volumes(store: Store, workers: WorkerClient) -> None:
    """Volumes asked to be deleted lose their image on their worker, then their row."""
    for vol in await store.volumes_to_delete():

        async def remove(w: Worker, vid: str = vol["id"]) -> None:
            await workers.delete_volume(w, vid)

        if await _remove_on_worker(store, vol["worker_id"], remove):
            await store.volume_deleted(vol["id"])


STALE_CHECKPOINT_S = 600.0  # far past the deadline of the calls that make and delete one


async def stale_checkpoints(store: Store, workers: WorkerClient) -> None:
    """Checkpoints the API left half-made or half-deleted lose their files, then their row."""
    for ck in await store.stale_checkpoints(STALE_CHECKPOINT_S):

        async def remove(w: Worker, sid: str = ck["sandbox_id"], cid: str = ck["id"]) -> None:
            await workers.delete_checkpoint(w, sid, cid)

        if await _remove_on_worker(store, ck["worker_id"], remove):
            await store.drop_checkpoint(ck["id"])
            log.info("checkpoint %s of %s was left %s; removed", ck["id"], ck["sandbox_id"],
                     ck["state"])  # fmt: skip


class TemplateBuilds:
    """Builds asked for are started on a worker (the template's own, or one with room); builds
    under way are asked how they did; deleted templates leave their worker once no sandbox of
    them is left."""

    def __init__(
        self, store: Store, workers: WorkerClient, sealer: Sealer, leadership: Leadership
    ) -> None:
        self.store = store
        self.workers = workers
        self.sealer = sealer
        self.leadership = leadership

    async def once(self) -> None:
        self.leadership.check()
        for build in await self.store.queued_builds():
            await self._start(build)
        for tpl in await self.store.templates_in("building"):
            await self._follow(tpl)
        for tpl in await self.store.templates_in("deleting"):
            if await self.store.template_users(tpl["id"]):
                continue  # its pool members are still being deleted

            async def remove(w: Worker, name: str = tpl["id"]) -> None:
                await self.workers.delete_template(w, name)

            # Its builder must let it go; other workers that pulled it, if they answer.
            copies = {
                w["id"] for w in await self.store.workers()
                if tpl["id"] in (w["templates"] or {}) and w["state"] == "active"
            }  # fmt: skip
            for worker_id in sorted(copies - {tpl["worker_id"]}):
                await _remove_on_worker(self.store, worker_id, remove)
            if await _remove_on_worker(self.store, tpl["worker_id"], remove):
                await self.store.forget_template(tpl["id"])

    async def _start(self, build: Row) -> None:
        workers = await self.store.workers()
        home = build["worker_id"]
        if build["checkpoint_id"] is not None:
            if build["checkpoint_state"] != "ready":
                gone = (
                    f"checkpoint {build['checkpoint_id']} is {build['checkpoint_state'] or 'gone'}"
                )
                await self.store.fail_queued_build(build["template_id"], build["request_id"], gone)
                return
            home = build["checkpoint_worker"]  # its files are there
        if home is not None and (build["checkpoint_id"] is not None or not build["artifact"]):
            # Its files (and its build cache) are there: the build must run on that worker.
            workers = [w for w in workers if w["id"] == home]
        # A template in the registry is rebuilt anywhere, where its build cache is if it can.
        prefer = {home} if home is not None else set()
        worker_id = pick_worker(workers, await self.store.worker_load(), BUILD_NEED, prefer=prefer)
        if worker_id is None:
            return  # it waits in the queue until there is room
        w = next(w for w in workers if w["id"] == worker_id)
        try:
            body = self._request(build)
        except (ValueError, SealError) as e:
            # A request no worker would take fails alone, not every build queued after it;
            # its error does not say what it held (the credentials may be in it).
            why = f"the build cannot be sent to a worker ({type(e).__name__})"
            log.warning("build %s of %s: %s", build["request_id"], build["template_id"], why)
            await self.store.fail_queued_build(build["template_id"], build["request_id"], why)
            return
        try:
            worker = Worker(w["id"], w["url"])
            started = await self.workers.start_build(worker, build["template_id"], body)
        except WorkerError as e:
            if e.status in (0, 412, 503):
                raise
            await self.store.fail_queued_build(build["template_id"], build["request_id"], e.detail)
            return
        await self.store.begin_build(
            build["template_id"], build["request_id"], worker_id, started.id
        )

    def _request(self, build: Row) -> BuildRequest:
        if build["checkpoint_id"] is not None:
            source = CheckpointSource(
                vm_id=build["checkpoint_sandbox"], checkpoint_id=build["checkpoint_id"]
            )
            return BuildRequest(checkpoint=source, request_id=build["request_id"])
        environ: dict[str, str] = {}
        if build["environ_sealed"] is not None:
            raw = self.sealer.open(build["environ_key_id"], bytes(build["environ_sealed"]),
                                   build_context(build["template_id"]))  # fmt: skip
            environ = json.loads(raw)
        return BuildRequest(
            spec=build["spec"], context=base64.b64encode(bytes(build["context"])).decode(),
            environ=environ, request_id=build["request_id"],
        )  # fmt: skip

    async def _follow(self, tpl: Row) -> None:
        worker = await self.store.worker(tpl["worker_id"])
        if worker is None or worker["state"] != "active":
            lost = f"worker {tpl['worker_id']} was lost during the build"
            await self.store.finish_build(tpl["id"], tpl["build_id"], None, lost)
            return
        try:
            status = await self.workers.build_status(Worker(worker["id"], worker["url"]),
                                                     tpl["build_id"])  # fmt: skip
        except WorkerError as e:
            if e.status == 404:  # the worker restarted: the build died with it
                lost = "the build was lost when its worker restarted"
                await self.store.finish_build(tpl["id"], tpl["build_id"], None, lost)
            return
        if status.state != "building":
            await self.store.finish_build(tpl["id"], tpl["build_id"], status.record, status.error)


async def every(seconds: float, name: str, fn: Callable[[], Awaitable[None]]) -> None:
    """Run `fn()` forever, `seconds` apart; an error is logged, not fatal (a lost leadership
    is)."""
    while True:
        try:
            await fn()
        except LostLeadership:
            raise
        except Exception:
            log.exception("%s failed", name)
        await asyncio.sleep(seconds)

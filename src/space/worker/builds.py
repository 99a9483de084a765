"""Template builds on this worker, asked for over its API: each runs in the background, keeps a
log any number of readers can follow, and on success makes the template usable at once.

A build's input is its spec (space.toml text), a build context (a tar of the files its `copy`
steps bring in) and the values of the environment variables the spec names for registry
credentials; none of them outlive the build. A build may instead make the template of a
checkpoint on this worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import shutil
import tarfile
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from space.worker.agent_client import AgentError
from space.worker.api.models import TEMPLATE
from space.worker.artifacts import templates as template_artifacts
from space.worker.sandboxes import VMManager, checkpoint_templates
from space.worker.sandboxes.errors import InvalidArgument, VMNotFound
from space.worker.templates import (
    BuildEnv,
    BuildError,
    BuildLog,
    TemplateError,
    TemplateRecord,
    TemplateSpec,
    build_template,
    list_templates,
    parse_spec,
    remove_template,
)
from space.worker.templates.errors import RegistryError
from space.worker.vmm.base import VMMError

log = logging.getLogger(__name__)

KEEP_FINISHED = 50  # finished builds whose status and log stay readable


class BuildRefused(Exception):
    """A build that cannot start: a bad spec or context (the message says what)."""


@dataclass
class Build:
    id: str
    name: str
    log: BuildLog
    request_id: str = ""
    state: str = "building"  # building | ready | failed
    error: str | None = None
    record: TemplateRecord | None = None
    artifact: str | None = None  # where it was pushed, if the deployment has a registry
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def status(self) -> dict[str, object]:
        record = self.record.to_json() if self.record else None
        if record is not None and self.artifact is not None:
            record["artifact"] = self.artifact
        return {"id": self.id, "name": self.name, "state": self.state, "error": self.error,
                "record": record}  # fmt: skip


class Builds:
    def __init__(self, manager: VMManager) -> None:
        self.manager = manager
        images = manager.templates["base"]
        self.env = BuildEnv(manager.driver, manager.pool, images.kernel, images.initrd,
                            manager.pool.root, egress=manager.egress)  # fmt: skip
        self._builds: dict[str, Build] = {}

    async def start(
        self, name: str, spec: str, context: bytes, environ: dict[str, str], request_id: str = ""
    ) -> Build:
        if (same := self._same(name, request_id)) is not None:
            return same
        workdir = Path(tempfile.mkdtemp(prefix="space-build-"))
        try:
            # Unpacking the context and matching its copy sources is file work: off the loop.
            parsed = await asyncio.to_thread(_prepare, spec, context, workdir)
            if parsed.name != name:
                raise BuildRefused(f"the spec builds template {parsed.name!r}, not {name!r}")
            same = self._same(name, request_id)  # the same request may have come meanwhile
        except (TemplateError, BuildRefused) as e:
            shutil.rmtree(workdir, ignore_errors=True)
            raise BuildRefused(str(e)) from None
        if same is not None:
            shutil.rmtree(workdir, ignore_errors=True)
            return same

        async def job(build_log: BuildLog) -> TemplateRecord:
            try:
                record = await build_template(parsed, self.env, build_log, environ=environ)
                self.manager.refresh_templates()
                return record
            finally:
                await asyncio.to_thread(shutil.rmtree, workdir, True)

        return self._run(name, request_id, job)

    def from_checkpoint(
        self, name: str, vm_id: str, checkpoint_id: str, request_id: str = ""
    ) -> Build:
        """Make template `name` of a checkpoint on this worker (`checkpoint_templates`)."""
        if not re.fullmatch(TEMPLATE, name) or name == "base":
            raise BuildRefused(f"{name!r} cannot name a template (it must match {TEMPLATE})")
        if (same := self._same(name, request_id)) is not None:
            return same
        if not (self.manager.layout.checkpoints / vm_id / checkpoint_id).is_dir():
            raise BuildRefused(f"VM {vm_id} has no checkpoint {checkpoint_id!r} here")

        async def job(build_log: BuildLog) -> TemplateRecord:
            try:
                return await checkpoint_templates.make(
                    self.manager, vm_id, checkpoint_id, name, build_log
                )
            except (VMNotFound, InvalidArgument) as e:
                raise BuildError(str(e)) from None
            except (VMMError, AgentError, TimeoutError) as e:
                raise BuildError(f"checkpoint {checkpoint_id} did not restore: {e}") from None

        return self._run(name, request_id, job)

    def _same(self, name: str, request_id: str) -> Build | None:
        """The build this request started before (a controller retrying after a crash)."""
        for b in self._builds.values():
            if request_id and b.request_id == request_id and b.name == name:
                return b
        if any(b.name == name and b.state == "building" for b in self._builds.values()):
            raise BuildRefused(f"a build of template {name} is under way")
        return None

    def _run(
        self, name: str, request_id: str, job: Callable[[BuildLog], Awaitable[TemplateRecord]]
    ) -> Build:
        build = Build(f"b-{uuid.uuid4().hex[:12]}", name, BuildLog(), request_id=request_id)

        async def run() -> None:
            try:
                had = {r.digest for r in list_templates(self.manager.pool.root) if r.name == name}
                record = await job(build.log)
                if self.manager.artifacts is not None:
                    build.artifact = await self._push(record, build.log, had)
                # Reported only once it is usable everywhere: a failed build has no record, so
                # the last good one stays in use.
                build.record = record
                build.state = "ready"
            except TemplateError as e:
                build.state, build.error = "failed", str(e)
                build.log(f"build failed: {e}")
            except Exception as e:  # logged whole here; the caller gets one clear line
                log.exception("build %s of %s failed", build.id, name)
                build.state, build.error = "failed", f"internal error: {type(e).__name__}: {e}"
                build.log(f"build failed: {build.error}")
            finally:
                build.log.close()

        build.task = asyncio.ensure_future(run())
        self._builds[build.id] = build
        self._forget_old()
        return build

    async def _push(self, record: TemplateRecord, say: BuildLog, had: set[str]) -> str:
        """Push the build; one that cannot be pushed leaves this worker too if it is new, for
        no other worker could run it."""
        assert self.manager.artifacts is not None
        try:
            pushed = await template_artifacts.push(self.manager.artifacts, record, say)
        except (RegistryError, OSError) as e:
            if record.digest not in had:
                await asyncio.to_thread(remove_template, self.manager.pool.root, record.name,
                                        record.digest)  # fmt: skip
                self.manager.refresh_templates()
            raise BuildError(
                f"the template was built but not pushed to the registry: {e}"
            ) from None
        say(f"pushed: {pushed.reference} ({pushed.uploaded} of {pushed.blobs} chunks sent)")
        return pushed.reference

    def get(self, build_id: str) -> Build | None:
        return self._builds.get(build_id)

    def _forget_old(self) -> None:
        finished = [b for b in self._builds.values() if b.state != "building"]
        for b in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._builds[b.id]

    async def close(self) -> None:
        for b in self._builds.values():
            if b.task is not None and not b.task.done():
                b.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await b.task


def _prepare(spec: str, context: bytes, workdir: Path) -> TemplateSpec:
    _unpack(context, workdir)
    return parse_spec(spec, workdir)


def _unpack(context: bytes, dest: Path) -> None:
    """A build context tar (plain or compressed): only regular files, directories and links
    that stay inside `dest`."""
    if not context:
        return
    try:
        with tarfile.open(fileobj=io.BytesIO(context), mode="r:*") as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise BuildRefused(f"the build context is not a usable tar archive: {e}") from None

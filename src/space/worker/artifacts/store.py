"""The deployment's registry as the store of what must outlive a host: bundles pushed and pulled
by digest, under `<registry>/<prefix>/<kind>s/<name>`.

A pull writes into a hidden directory beside its destination and renames it into place only
once every chunk is written, so a pull that fails or dies leaves nothing a reader could take
for whole; the same bundle pulled twice at once is pulled once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from space.settings import RegistrySettings
from space.worker.artifacts import bundle
from space.worker.templates import oci
from space.worker.templates.errors import RegistryError
from space.worker.templates.registry import Credentials, ImageReference, RegistryClient

log = logging.getLogger(__name__)

PLURAL = {"template": "templates", "sandbox": "sandboxes", "volume": "volumes"}
IN_FLIGHT = 4  # chunks compressed or sent at once: bounds memory to a few chunks
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Pushed:
    reference: str  # registry/repository@sha256:…, what a pull is given
    size: int  # of the files
    blobs: int  # chunks in the bundle
    uploaded: int  # of them, those the registry did not have


class Artifacts:
    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        ref = ImageReference.parse(f"{settings.url.rstrip('/')}/x")
        self.registry = ref.registry
        self.prefix = ref.repository.removesuffix("/x")
        self._credentials = (
            Credentials(settings.username, settings.password) if settings.username else None
        )
        self._pulls: dict[tuple[str, Path], asyncio.Task[bundle.Layout]] = {}

    def _client(self, repository: str, digest: str | None = None) -> RegistryClient:
        ref = ImageReference(self.registry, repository, digest=digest)
        return RegistryClient(ref, credentials=self._credentials, insecure=self.settings.insecure)

    def repository(self, kind: str, name: str) -> str:
        return f"{self.prefix}/{PLURAL[kind]}/{name.lower()}"

    # --- push ------------------------------------------------------------------------------

    async def push(
        self, kind: str, name: str, tag: str, root: Path, meta: dict[str, Any],
        progress: Progress | None = None,
    ) -> Pushed:  # fmt: skip
        """Every file under `root` as one bundle, tagged `tag` in `kind`s/`name`."""
        files = bundle.files_of(root)
        chunks = [
            bundle.Chunk(f.path, offset, min(bundle.CHUNK, f.size - offset))
            for f in files
            for offset in bundle.data_chunks(root / f.path, f.size)
        ]
        total = sum(c.length for c in chunks)
        repository = self.repository(kind, name)
        say = _Meter(progress, f"pushing {kind} {name}", total)
        slots = asyncio.Semaphore(IN_FLIGHT)
        async with self._client(repository) as client:

            async def one(chunk: bundle.Chunk) -> tuple[dict[str, Any] | None, bool]:
                async with slots:
                    blob = await asyncio.to_thread(_packed, root / chunk.file, chunk)
                    if blob is None:
                        say.add(chunk.length)
                        return None, False
                    digest = oci.sha256_digest(blob)
                    sent = await client.push_blob(blob, digest)
                    say.add(chunk.length)
                    return bundle.chunk_descriptor(digest, len(blob), chunk), sent

            results = await asyncio.gather(*(one(c) for c in chunks))
            layers = [d for d, _ in results if d is not None]
            config = bundle.config(kind, files, meta)
            await client.push_blob(config, oci.sha256_digest(config))
            doc = bundle.manifest(config, layers, kind)
            digest = await client.push_manifest(tag, doc, oci.MEDIA_OCI_MANIFEST)
        say.done()
        return Pushed(f"{self.registry}/{repository}@{digest}", sum(f.size for f in files),
                      len(layers), sum(sent for _, sent in results))  # fmt: skip

    # --- pull ------------------------------------------------------------------------------

    async def pull(
        self, reference: str, kind: str, dest: Path, progress: Progress | None = None
    ) -> bundle.Layout:
        """The bundle at `reference` written to `dest`, which must not exist yet; a pull of
        the same already under way is joined."""
        key = (reference, dest)
        task = self._pulls.get(key)
        if task is None:
            task = asyncio.ensure_future(self._pull(reference, kind, dest, progress))
            self._pulls[key] = task
            task.add_done_callback(lambda _: self._pulls.pop(key, None))
        return await asyncio.shield(task)

    def _own(self, reference: str) -> ImageReference:
        ref = ImageReference.parse(reference)
        if ref.registry != self.registry or not ref.repository.startswith(f"{self.prefix}/"):
            raise RegistryError(f"{reference} is not in this deployment's registry")
        if not ref.digest:
            raise RegistryError(f"{reference} is not pinned by a digest")
        return ref

    async def _pull(
        self, reference: str, kind: str, dest: Path, progress: Progress | None
    ) -> bundle.Layout:
        ref = self._own(reference)
        assert ref.digest is not None
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".pull-", dir=dest.parent))
        try:
            async with self._client(ref.repository, ref.digest) as client:
                doc = await client.document(ref.digest)
                config = await client.read_verified(doc.config, 1 << 20)
                plan = bundle.layout(config, doc, kind)
                await asyncio.to_thread(bundle.prepare, tmp, plan.files)
                say = _Meter(progress, f"pulling {kind} {ref.repository}", plan.size)
                slots = asyncio.Semaphore(IN_FLIGHT)

                async def one(desc: oci.Descriptor, chunk: bundle.Chunk) -> None:
                    async with slots:
                        blob = await client.read_verified(desc, bundle.MAX_BLOB)
                        await asyncio.to_thread(bundle.write_chunk, tmp, chunk, blob)
                        say.add(chunk.length)

                await asyncio.gather(*(one(d, c) for d, c in plan.chunks))
            bundle.finish(tmp, plan.files)
            tmp.chmod(0o755)
            tmp.rename(dest)
            say.done()
            return plan
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    async def delete(self, reference: str) -> None:
        """Forget a bundle's manifest (its blobs go at the registry's garbage collection)."""
        ref = self._own(reference)
        async with self._client(ref.repository, ref.digest) as client:
            with contextlib.suppress(RegistryError):
                await client.delete_manifest(ref.digest or "")


def _packed(path: Path, chunk: bundle.Chunk) -> bytes | None:
    data = bundle.read_chunk(path, chunk.offset, chunk.length)
    return None if data is None else bundle.compress(data)


class _Meter:
    """A line at start, every tenth of the way and at the end, with the rate."""

    def __init__(self, progress: Progress | None, what: str, total: int) -> None:
        self.progress, self.what, self.total = progress, what, total
        self.seen, self.shown, self.started = 0, 0, time.monotonic()
        self._say(f"{what}: {total / (1 << 20):.0f} MiB of data")

    def _say(self, line: str) -> None:
        log.info("%s", line)
        if self.progress is not None:
            self.progress(line)

    def add(self, n: int) -> None:
        self.seen += n
        tenth = self.seen * 10 // max(self.total, 1)
        if tenth > self.shown and self.seen < self.total:
            self.shown = tenth
            self._say(f"{self.what}: {tenth * 10}%")

    def done(self) -> None:
        took = time.monotonic() - self.started
        rate = self.total / (1 << 20) / max(took, 1e-6)
        self._say(f"{self.what}: done in {took:.1f} s ({rate:.0f} MiB/s)")

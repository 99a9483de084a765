"""The deployment's registry as the store of what must outlive a host: bundles pushed and pulled
by digest, under `<registry>/<prefix>/<kind>s/<name>`.

A pull writes into a hidden directory beside its destination and renames it into place only
once every chunk is written, so a pull that fails or dies leaves nothing a reader could take
for whole; the same bundle pulled twice at once is pulled once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
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
from space.worker.templates.errors import ImageError, RegistryError
from space.worker.templates.registry import (
    REPOSITORY,
    Credentials,
    ImageReference,
    RegistryClient,
)

log = logging.getLogger(__name__)

PLURAL = {"template": "templates", "sandbox": "sandboxes", "volume": "volumes",
          "snapshot": "snapshots"}  # fmt: skip
_REPOSITORY = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
IN_FLIGHT = 4  # chunks compressed or sent at once: bounds memory to a few chunks
FIND_S = 5.0  # a look-up on the way of a create: a registry away costs it no more
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Pushed:
    reference: str  # registry/repository@sha256:…, what a pull is given
    size: int  # of the files
    blobs: int  # chunks in the bundle
    uploaded: int  # of them, those the registry did not have


class NotOurs(ImageError):
    """A reference this deployment did not push for what it is asked for."""


class Artifacts:
    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        self.registry, _, prefix = settings.url.strip("/").partition("/")
        self.prefix = f"{prefix}/" if prefix else ""
        host = self.registry.rpartition("@")[2]
        if not ("." in host or ":" in host or host == "localhost") or (
            prefix and not REPOSITORY.match(prefix)
        ):  # fmt: skip
            raise ValueError(
                f"SPACE_REGISTRY={settings.url!r} must be a registry's host[:port] (with a dot, "
                "a port or localhost), then an optional path of lower-case names"
            )
        self._credentials = (
            Credentials(settings.username, settings.password) if settings.username else None
        )
        self._pulls: dict[tuple[str, Path], asyncio.Task[bundle.Layout]] = {}

    def _client(
        self, repository: str, digest: str | None = None, timeout: float = 60.0
    ) -> RegistryClient:
        ref = ImageReference(self.registry, repository, digest=digest)
        return RegistryClient(ref, credentials=self._credentials, insecure=self.settings.insecure,
                              timeout=timeout)  # fmt: skip

    def repository(self, kind: str, name: str) -> str:
        """One repository per thing. A name that is no valid repository component (templates
        allow `a..b`, `a-`) gets a slug, made unique by a hash of the name."""
        slug = name.lower()
        if not REPOSITORY.match(slug):
            tidy = re.sub(r"[^a-z0-9]+", "-", slug).strip("-") or "x"
            slug = f"{tidy}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"
        return f"{self.prefix}{PLURAL[kind]}/{slug}"

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

    async def find(self, kind: str, name: str, tag: str) -> str | None:
        """The reference of the bundle tagged `tag` in `kind` `name`; None if there is none."""
        repository = self.repository(kind, name)
        async with self._client(repository, timeout=FIND_S) as client:
            digest = await client.digest_of(tag)
        return f"{self.registry}/{repository}@{digest}" if digest else None

    # --- pull ------------------------------------------------------------------------------

    async def pull(
        self, reference: str, kind: str, name: str, dest: Path, progress: Progress | None = None
    ) -> bundle.Layout:
        """The bundle at `reference`, which must be in the repository of `kind` `name`, written
        to `dest`, which must not exist yet; a pull of the same already under way is joined."""
        key = (reference, dest)
        task = self._pulls.get(key)
        if task is None:
            ref = self._own(reference, self.repository(kind, name))
            task = asyncio.ensure_future(self._pull(ref, kind, dest, progress))
            self._pulls[key] = task
            task.add_done_callback(lambda _: self._pulls.pop(key, None))
        return await asyncio.shield(task)

    def _own(self, reference: str, repository: str | None = None) -> ImageReference:
        """The reference, if it is pinned and in this deployment's registry (in `repository`,
        if given: a bundle pushed for one thing is never taken for another)."""
        ref = ImageReference.parse(reference)
        if ref.registry != self.registry or not ref.repository.startswith(self.prefix):
            raise NotOurs(f"{reference} is not in this deployment's registry")
        if repository is not None and ref.repository != repository:
            raise NotOurs(f"{reference} is not in {self.registry}/{repository}")
        if not ref.digest:
            raise NotOurs(f"{reference} is not pinned by a digest")
        return ref

    async def _pull(
        self, ref: ImageReference, kind: str, dest: Path, progress: Progress | None
    ) -> bundle.Layout:
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

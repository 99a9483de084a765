"""Where a template's file system comes from, and how it gets into a root directory.

`from` in a spec names one of:
  oci://[registry/]name[:tag][@digest]   an image in a registry (linux/amd64)
  oci-layout:DIR[:TAG]                   an OCI image layout directory
  oci-archive:FILE                       a tarball of an OCI layout, or a `docker save` tarball
  docker-archive:FILE                    the same (either format is recognised by its content)
  dir:DIR                                a plain root directory
  tar:FILE                               a plain root tarball (plain, gzip or zstd)
  debian:bookworm                        the Debian base SPACE builds itself (`space image base`)
  space:NAME                             one of SPACE's own images (`space image NAME`):
                                         base, code-interpreter

`resolve_source` finds out what the source is (its digest: the first link of the build's cache
key) without unpacking it; `Source.unpack` then writes the root directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from space.worker.images import base as base_image
from space.worker.images import code_interpreter
from space.worker.templates import oci
from space.worker.templates.errors import ImageError, RegistryError, SpecError
from space.worker.templates.registry import Credentials, ImageReference, RegistryClient

Log = Callable[[str], None]
KINDS = ("oci", "oci-layout", "oci-archive", "docker-archive", "dir", "tar", "debian", "space")
OWN_IMAGES = {f.name: f for f in (base_image.BASE, code_interpreter.FLAVOR)}


@dataclass(frozen=True)
class SourceRef:
    kind: str
    location: str

    @classmethod
    def parse(cls, text: str, base_dir: Path | None = None) -> SourceRef:
        if text.startswith("oci://"):
            try:
                ImageReference.parse(text)  # fail early on a malformed reference
            except RegistryError as e:
                raise SpecError(f"'from = {text!r}': {e}") from None
            return cls("oci", text)
        kind, sep, location = text.partition(":")
        if not sep or kind not in KINDS or not location:
            raise SpecError(
                f"'from = {text!r}' names no known source; use one of oci://REGISTRY/NAME:TAG, "
                "oci-layout:DIR, oci-archive:FILE, docker-archive:FILE, dir:DIR, tar:FILE, "
                "debian:bookworm, space:NAME"
            )
        if kind == "debian":
            if location != base_image.SUITE:
                raise SpecError(
                    f"'from = {text!r}': only debian:{base_image.SUITE} is available as a base"
                )
            return cls(kind, location)
        if kind == "space":
            if location not in OWN_IMAGES:
                raise SpecError(f"'from = {text!r}': SPACE's own images are "
                                f"{', '.join(f'space:{n}' for n in OWN_IMAGES)}")  # fmt: skip
            return cls(kind, location)
        path = Path(location)
        if not path.is_absolute() and base_dir is not None:
            location = str(base_dir / path)
        return cls(kind, location)

    def __str__(self) -> str:
        return self.location if self.kind == "oci" else f"{self.kind}:{self.location}"


@dataclass
class Source:
    """A resolved source: its identity, its image config, and how to materialise it."""

    ref: SourceRef
    digest: str
    config: oci.ImageConfig = field(default_factory=oci.ImageConfig)
    # Either a root directory is written by `unpack`, or the source already is an ext4 image,
    # known to the pool by `image_key` (so that its copy there is shared with other users).
    image: Path | None = None
    image_key: str = ""
    _unpack: Callable[[Path, Log], Any] | None = None

    async def unpack(self, root: Path, log: Log) -> None:
        assert self._unpack is not None
        result = self._unpack(root, log)
        if asyncio.iscoroutine(result):
            await result


async def resolve_source(
    ref: SourceRef,
    log: Log,
    *,
    credentials: Credentials | None = None,
    insecure: bool = False,
) -> Source:
    if ref.kind == "oci":
        return await _registry_source(ref, log, credentials, insecure)
    if ref.kind in ("debian", "space"):
        flavor = OWN_IMAGES[ref.location if ref.kind == "space" else base_image.BASE.name]
        tpl = await asyncio.to_thread(base_image.ensure_image, flavor, log)
        # Its key in the pool (`space.worker.images.defaults` imports `base` under the same).
        key = f"{flavor.name}-{tpl.key}"
        return Source(ref, digest=f"space-{flavor.name}:{tpl.key}", image=tpl.rootfs,
                      image_key=key)  # fmt: skip
    path = Path(ref.location)
    if not path.exists():
        raise SpecError(f"source {ref}: {path} does not exist")
    if ref.kind == "dir":
        if not path.is_dir():
            raise SpecError(f"source {ref}: {path} is not a directory")
        digest = await asyncio.to_thread(tree_digest, path)
        return Source(ref, digest=digest, _unpack=lambda root, log: _copy_tree(path, root, log))
    if ref.kind == "tar":
        digest = await asyncio.to_thread(file_digest, path)

        def unpack_tar(root: Path, log: Log) -> None:
            with path.open("rb") as f:
                n = oci.apply_layer(root, f, what=str(path))
            log(f"unpacked {n} entries from {path.name}")

        return Source(
            ref, digest=digest, _unpack=lambda root, log: asyncio.to_thread(unpack_tar, root, log)
        )
    return await asyncio.to_thread(_layout_source, ref, path)


# --- registry ----------------------------------------------------------------------------------


async def _registry_source(
    ref: SourceRef, log: Log, credentials: Credentials | None, insecure: bool
) -> Source:
    image = ImageReference.parse(ref.location)
    async with RegistryClient(image, credentials=credentials, insecure=insecure) as client:
        pulled = await client.pull_manifest()
    layers = pulled.manifest.layers
    log(f"{image}: manifest {pulled.digest[:19]}, {len(layers)} layer(s)")

    async def unpack(root: Path, log: Log) -> None:
        async with RegistryClient(image, credentials=credentials, insecure=insecure) as client:
            for i, layer in enumerate(layers, 1):
                path = await client.fetch_blob(layer)
                log(f"layer {i}/{len(layers)} {layer.digest[:19]} ({layer.size / 1e6:.1f} MB)")
                with path.open("rb") as f:
                    await asyncio.to_thread(oci.apply_layer, root, f, what=f"layer {layer.digest}")

    return Source(ref, digest=pulled.digest, config=pulled.config, _unpack=unpack)


# --- OCI layouts and docker-save archives ------------------------------------------------------


class _Store:
    """Reads the files of a layout, from a directory or from inside a tarball."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tar: tarfile.TarFile | None = None
        self.names: dict[str, tarfile.TarInfo] = {}
        if path.is_file():
            try:
                self.tar = tarfile.open(path)  # noqa: SIM115 - open for the store's life; close()
            except (tarfile.TarError, OSError) as e:
                raise ImageError(f"{path} is not a readable tarball: {e}") from None
            for m in self.tar.getmembers():
                self.names[m.name.removeprefix("./")] = m

    def exists(self, name: str) -> bool:
        return name in self.names if self.tar else (self.path / name).is_file()

    @contextlib.contextmanager
    def open(self, name: str) -> Iterator[IO[bytes]]:
        if self.tar is not None:
            member = self.names.get(name)
            f = self.tar.extractfile(member) if member is not None else None
            if f is None:
                raise ImageError(f"{self.path}: {name} is missing from the archive")
            with f:
                yield f
        else:
            p = self.path / name
            if not p.is_file():
                raise ImageError(f"{self.path}: {name} is missing from the layout")
            with p.open("rb") as fh:
                yield fh

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except ValueError as e:
            raise ImageError(f"{self.path}: {name} is not JSON: {e}") from None

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()


def _blob_name(digest: str) -> str:
    oci.check_digest(digest)
    return "blobs/sha256/" + digest.removeprefix("sha256:")


def _layout_source(ref: SourceRef, path: Path) -> Source:
    location, tag = str(path), None
    if ref.kind == "oci-layout" and not path.exists() and ":" in ref.location:
        location, _, tag = ref.location.rpartition(":")
    store = _Store(Path(location))
    layers: list[tuple[str, str | None]]
    try:
        if store.exists("oci-layout") and store.exists("index.json"):
            digest, manifest, config = _read_oci_layout(store, tag)
            layers = [(_blob_name(d.digest), d.digest) for d in manifest.layers]
        elif store.exists("manifest.json"):
            digest, layers, config = _read_docker_save(store)
        else:
            raise ImageError(
                f"{location} is neither an OCI image layout (oci-layout, index.json) nor a "
                "`docker save` archive (manifest.json)"
            )
    finally:
        store.close()

    def unpack(root: Path, log: Log) -> None:
        store = _Store(Path(location))
        try:
            for i, (name, blob_digest) in enumerate(layers, 1):
                log(f"layer {i}/{len(layers)} {name}")
                with store.open(name) as f:
                    oci.apply_layer(root, f, what=f"layer {name}", digest=blob_digest)
        finally:
            store.close()

    return Source(
        ref,
        digest=digest,
        config=config,
        _unpack=lambda root, log: asyncio.to_thread(unpack, root, log),
    )


def _read_oci_layout(store: _Store, tag: str | None) -> tuple[str, oci.Manifest, oci.ImageConfig]:
    index = oci.parse_document(store.read("index.json"), oci.MEDIA_OCI_INDEX)
    if not isinstance(index, oci.Index):
        raise ImageError(f"{store.path}: index.json is not an image index")
    candidates = index.manifests
    if tag is not None:
        candidates = [
            m for m in candidates if m.annotations.get("org.opencontainers.image.ref.name") == tag
        ]
        if not candidates:
            raise ImageError(f"{store.path}: no image tagged {tag!r} in index.json")
    desc = oci.choose_platform(oci.Index(candidates)) if len(candidates) > 1 else candidates[0]
    for _ in range(4):  # nested indexes, as `docker save` of a multi-platform image has
        data = store.read(_blob_name(desc.digest))
        if oci.sha256_digest(data) != desc.digest:
            raise ImageError(f"{store.path}: blob {desc.digest} does not match its digest")
        doc = oci.parse_document(data, desc.media_type)
        if isinstance(doc, oci.Manifest):
            config = oci.ImageConfig.from_json(store.json(_blob_name(doc.config.digest)))
            return desc.digest, doc, config
        desc = oci.choose_platform(doc)
    raise ImageError(f"{store.path}: image indexes nest too deep")


def _read_docker_save(store: _Store) -> tuple[str, list[tuple[str, str | None]], oci.ImageConfig]:
    items = store.json("manifest.json")
    if not isinstance(items, list) or len(items) != 1 or not isinstance(items[0], dict):
        raise ImageError(f"{store.path}: manifest.json must describe exactly one image")
    item = items[0]
    config_name, layer_names = item.get("Config"), item.get("Layers")
    if not isinstance(config_name, str) or not isinstance(layer_names, list):
        raise ImageError(f"{store.path}: manifest.json lacks Config or Layers")
    config_bytes = store.read(config_name)
    config = oci.ImageConfig.from_json(json.loads(config_bytes))
    layers: list[tuple[str, str | None]] = []
    for name in layer_names:
        name = str(name)
        # Newer `docker save` names layers by their digest (blobs/sha256/<hex>): check it then.
        hexpart = name.removeprefix("blobs/sha256/")
        digest = f"sha256:{hexpart}" if name.startswith("blobs/sha256/") else None
        layers.append((name, digest))
    return oci.sha256_digest(config_bytes), layers, config


# --- directories and files -----------------------------------------------------------------------


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def tree_digest(root: Path, skip: Callable[[Path], bool] | None = None) -> str:
    """A hash of a directory tree: names, types, modes, owners, link targets and contents (of
    what `skip` does not leave out; what it leaves out of a directory it walks all the same,
    as a `!` pattern of an ignore file may take it back)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted([*dirnames, *filenames]):
            p = Path(dirpath, name)
            if skip is not None and skip(p):
                continue
            st = p.lstat()
            rel = os.path.relpath(p, root)
            h.update(f"{rel}\0{st.st_mode:o}\0{st.st_uid}:{st.st_gid}\0".encode())
            if p.is_symlink():
                h.update(os.readlink(p).encode())
            elif p.is_file():
                h.update(file_digest(p).encode())
            h.update(b"\n")
    return "sha256:" + h.hexdigest()


async def _copy_tree(src: Path, root: Path, log: Log) -> None:
    # cp -a keeps owners, modes, links and xattrs, and reflinks where the file system can.
    proc = await asyncio.create_subprocess_exec(
        "cp", "-a", "--reflink=auto", f"{src}/.", f"{root}/",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise ImageError(f"copying {src} failed: {out.decode(errors='replace').strip()}")
    log(f"copied {src}")

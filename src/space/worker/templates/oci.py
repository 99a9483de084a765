"""OCI images on disk: manifests, image configs, and layers unpacked safely into a root directory.

Layers are applied in order the way a container runtime does: `.wh.<name>` deletes `<name>` of
the layers below, `.wh..wh..opq` empties its directory of what the layers below put there. Every
path is resolved as if the root were `/` (a `chroot`): symlinks met on the way, absolute or
relative, stay inside the root, entries naming `..` are refused, and the last component of an
entry is never followed, so a layer cannot write outside the root whatever links it plants.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import zstandard

from space.worker.templates.errors import DigestMismatch, ImageError, UnsafeLayer

MEDIA_DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MEDIA_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MEDIA_OCI_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPES = (MEDIA_OCI_INDEX, MEDIA_DOCKER_LIST)
MANIFEST_TYPES = (MEDIA_OCI_MANIFEST, MEDIA_DOCKER_MANIFEST)
ACCEPT = ", ".join((*MANIFEST_TYPES, *INDEX_TYPES))

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
_MAX_LINKS = 40  # symlinks followed while resolving one path, as Linux allows
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# --- manifests and configs -------------------------------------------------------------------


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    platform: dict[str, str] | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, what: str) -> Descriptor:
        if not isinstance(data, dict):
            raise ImageError(f"{what}: a descriptor must be an object")
        digest, size = data.get("digest"), data.get("size")
        if not isinstance(digest, str) or not isinstance(size, int):
            raise ImageError(f"{what}: a descriptor needs a digest and a size")
        check_digest(digest)
        plat = data.get("platform")
        return cls(
            media_type=str(data.get("mediaType", "")),
            digest=digest,
            size=size,
            platform={str(k): str(v) for k, v in plat.items()} if isinstance(plat, dict) else None,
            annotations=dict(data.get("annotations") or {}),
        )


@dataclass(frozen=True)
class Manifest:
    config: Descriptor
    layers: list[Descriptor]


@dataclass(frozen=True)
class Index:
    manifests: list[Descriptor]


@dataclass(frozen=True)
class ImageConfig:
    """What of an image config a template keeps: how its processes run."""

    env: dict[str, str] = field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    workdir: str | None = None
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    user: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> ImageConfig:
        if not isinstance(data, dict):
            raise ImageError("the image config is not a JSON object")
        cfg = data.get("config") or {}
        if not isinstance(cfg, dict):
            raise ImageError("the image config's 'config' is not an object")
        env: dict[str, str] = {}
        for item in cfg.get("Env") or []:
            key, sep, value = str(item).partition("=")
            if sep and key:
                env[key] = value
        return cls(
            env=env or {"PATH": DEFAULT_PATH},
            workdir=str(cfg["WorkingDir"]) if cfg.get("WorkingDir") else None,
            entrypoint=[str(a) for a in cfg.get("Entrypoint") or []],
            cmd=[str(a) for a in cfg.get("Cmd") or []],
            user=str(cfg["User"]) if cfg.get("User") else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "env": dict(self.env),
            "workdir": self.workdir,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
            "user": self.user,
        }


def check_digest(digest: str) -> None:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise ImageError(f"unsupported or malformed digest {digest!r} (only sha256 is supported)")


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def parse_document(data: bytes, content_type: str | None = None) -> Manifest | Index:
    """A manifest or an index (manifest list), Docker or OCI, by its media type or its shape."""
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise ImageError(f"the manifest is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise ImageError("the manifest is not a JSON object")
    media = str(doc.get("mediaType") or (content_type or "").split(";")[0].strip())
    old = doc.get("schemaVersion") == 1 or "prettyjws" in media or media.endswith("v1+json")
    if old and media not in (MEDIA_OCI_INDEX, MEDIA_OCI_MANIFEST):
        raise ImageError(
            "the image uses the old Docker schema 1 manifest; push it again with a current "
            "tool (it then gets a schema 2 or OCI manifest)"
        )
    if media in INDEX_TYPES or (not media and "manifests" in doc):
        items = doc.get("manifests")
        if not isinstance(items, list):
            raise ImageError("the image index has no 'manifests' list")
        return Index([Descriptor.from_json(m, "image index") for m in items])
    if media in MANIFEST_TYPES or (not media and "layers" in doc):
        layers = doc.get("layers")
        if not isinstance(layers, list):
            raise ImageError("the manifest has no 'layers' list")
        return Manifest(
            config=Descriptor.from_json(doc.get("config"), "manifest config"),
            layers=[Descriptor.from_json(layer, "manifest layer") for layer in layers],
        )
    raise ImageError(f"unsupported manifest media type {media!r}")


def choose_platform(index: Index, os_name: str = "linux", arch: str = "amd64") -> Descriptor:
    """The index entry for os/arch (the build VM runs amd64 Linux)."""
    found = [
        m
        for m in index.manifests
        if m.platform is not None
        and m.platform.get("os") == os_name
        and m.platform.get("architecture") == arch
    ]
    if found:
        return found[0]
    # An index without platforms (e.g. a single-image OCI layout) has one obvious choice.
    if len(index.manifests) == 1 and index.manifests[0].platform is None:
        return index.manifests[0]
    offered = sorted(
        f"{m.platform.get('os')}/{m.platform.get('architecture')}"
        for m in index.manifests
        if m.platform
    )
    raise ImageError(
        f"the image has no {os_name}/{arch} variant (it offers: {', '.join(offered) or 'none'})"
    )


# --- reading layers --------------------------------------------------------------------------


class _Hashing:
    """A read-only stream that hashes what passes through, to check a blob's digest."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.hash.update(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


class _Prefixed:
    """A stream whose first bytes were already read (to sniff the compression)."""

    def __init__(self, head: bytes, rest: _Hashing) -> None:
        self.head = head
        self.rest = rest

    def read(self, n: int = -1) -> bytes:
        if self.head:
            if n < 0:
                data, self.head = self.head + self.rest.read(), b""
                return data
            data, self.head = self.head[:n], self.head[n:]
            return data
        return self.rest.read(n)


@contextlib.contextmanager
def open_tar_stream(raw: IO[bytes] | _Hashing, what: str) -> Iterator[tarfile.TarFile]:
    """A streaming tar reader over plain, gzip or zstd data, told apart by their magic bytes."""
    src = raw if isinstance(raw, _Hashing) else _Hashing(raw)
    head = src.read(4)
    stream: Any = _Prefixed(head, src)
    if head.startswith(_GZIP_MAGIC):
        stream = gzip.GzipFile(fileobj=stream, mode="rb")
    elif head.startswith(_ZSTD_MAGIC):
        stream = zstandard.ZstdDecompressor().stream_reader(stream)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tf:
            yield tf
    except (tarfile.TarError, EOFError, OSError, zstandard.ZstdError) as e:
        if isinstance(e, UnsafeLayer | DigestMismatch):
            raise
        raise ImageError(f"{what}: not a readable tar archive: {e}") from None


def _parts(name: str, what: str) -> list[str]:
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeLayer(f"{what}: entry {name!r} climbs out of the root with '..'; refused")
    return parts


class RootDir:
    """A directory that entries are written into as if it were `/` (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))

    def resolve(self, parts: list[str], follow_last: bool = True) -> Path:
        """The real path of `/parts...` inside the root, symlinks followed as under chroot.

        Components that do not exist yet are kept as they are (they will be created).
        """
        todo = list(parts)
        done: list[str] = []
        links = 0
        while todo:
            part = todo.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            here = self.root.joinpath(*done, part)
            if (todo or follow_last) and here.is_symlink():
                links += 1
                if links > _MAX_LINKS:
                    raise UnsafeLayer(f"too many levels of symlinks under /{'/'.join(parts)}")
                target = os.readlink(here)
                if target.startswith("/"):
                    done = []
                todo = target.split("/") + todo
                continue
            done.append(part)
        return self.root.joinpath(*done)

    def ensure_dir(self, path: Path) -> None:
        """`path` (resolved already) as a directory, with parents; replaces a non-directory."""
        if path == self.root:
            return
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        if not path.exists():
            self.ensure_dir(path.parent)
            path.mkdir(mode=0o755)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path)


def apply_layer(root: Path, raw: IO[bytes], *, what: str, digest: str | None = None) -> int:
    """Apply one layer (tar, tar+gzip or tar+zstd) on top of `root`; returns entries applied.

    With `digest`, the layer's bytes must hash to it (checked once all of them were read).
    """
    rd = RootDir(root)
    hashing = _Hashing(raw)
    created: set[Path] = set()  # written by this layer: an opaque marker keeps these
    count = 0
    with open_tar_stream(hashing, what) as tf:
        for member in tf:
            parts = _parts(member.name, what)
            if not parts:
                continue  # the root itself ("./")
            base = parts[-1]
            parent = rd.resolve(parts[:-1])
            rd.ensure_dir(parent)
            if base == OPAQUE:
                for child in list(parent.iterdir()):
                    if child not in created:
                        _remove(child)
                continue
            if base.startswith(WHITEOUT):
                _remove(parent / base[len(WHITEOUT) :])
                continue
            target = parent / base
            _write_entry(rd, tf, member, target, what)
            created.add(target)
            count += 1
        # The tar end marker can be followed by padding that the hash must still see.
        hashing.drain()
    if digest is not None:
        got = "sha256:" + hashing.hash.hexdigest()
        if got != digest:
            raise DigestMismatch(f"{what}: content hashes to {got}, expected {digest}")
    return count


def _write_entry(
    rd: RootDir, tf: tarfile.TarFile, member: tarfile.TarInfo, target: Path, what: str
) -> None:
    exists = target.is_symlink() or target.exists()
    if exists and not (member.isdir() and target.is_dir() and not target.is_symlink()):
        _remove(target)
    if member.isdir():
        if not target.is_dir():
            target.mkdir(mode=0o700)
    elif member.isreg():
        src = tf.extractfile(member)
        assert src is not None
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    elif member.issym():
        os.symlink(member.linkname, target)
    elif member.islnk():
        source = rd.resolve(_parts(member.linkname, what), follow_last=False)
        if not source.is_symlink() and (not source.exists() or source.is_dir()):
            raise ImageError(f"{what}: hard link {member.name!r} to a missing {member.linkname!r}")
        os.link(source, target, follow_symlinks=False)
        return  # a hard link shares its source's metadata
    elif member.ischr() or member.isblk():
        kind = stat.S_IFCHR if member.ischr() else stat.S_IFBLK
        os.mknod(target, kind | 0o600, os.makedev(member.devmajor, member.devminor))
    elif member.isfifo():
        os.mkfifo(target, 0o600)
    else:
        return  # sockets and other oddities have no place in an image
    with contextlib.suppress(PermissionError):
        os.lchown(target, member.uid, member.gid)
    if not member.issym():
        # After chown, which clears set-uid bits.
        os.chmod(target, member.mode & 0o7777)
    for key, value in member.pax_headers.items():
        if key.startswith("SCHILY.xattr."):
            with contextlib.suppress(OSError):
                os.setxattr(
                    target,
                    key[len("SCHILY.xattr.") :],
                    value.encode("utf-8", "surrogateescape"),
                    follow_symlinks=False,
                )
    if not member.isdir():
        with contextlib.suppress(OSError):
            os.utime(target, (member.mtime, member.mtime), follow_symlinks=False)

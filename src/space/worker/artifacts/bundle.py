"""A directory as an OCI artifact: its files cut in fixed chunks, each compressed and named by
its digest, and a config that lists the files.

Holes cost nothing: a chunk that is all zeros (a sparse disk's unwritten blocks) is not pushed,
and a pulled file is made sparse at its full size before its chunks are written, so it takes on
disk what it took where it was pushed from. Equal chunks share one blob, in a push and across
pushes to a repository: a second push of a template or a snapshot uploads only what changed.

A pulled bundle is trusted only as far as it checks: every blob against its digest (the
registry client), every path inside the directory, every chunk inside its file and of its
stated length, and the whole within the sizes it declared.
"""

from __future__ import annotations

import io
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import zstandard

from space.worker import formats
from space.worker.templates import oci
from space.worker.templates.errors import ImageError

CHUNK = 16 << 20
MAX_BLOB = CHUNK + (CHUNK >> 4)  # a chunk that does not compress grows a little
MAX_FILE = 1 << 40
MAX_FILES = 64
ARTIFACT_TYPE = "application/vnd.space.bundle.v1"
CONFIG_TYPE = "application/vnd.space.bundle.config.v1+json"
CHUNK_TYPE = "application/vnd.space.chunk.v1+zstd"
BLOCK = 64 << 10  # the grain at which a pulled file stays sparse
_ZEROS = bytes(CHUNK)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, '/'-separated
    size: int
    mode: int


@dataclass(frozen=True)
class Chunk:
    file: str
    offset: int
    length: int


def files_of(root: Path) -> list[FileEntry]:
    """Every regular file under `root` (directories are made as files need them)."""
    out = []
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISREG(st.st_mode):
                rel = path.relative_to(root).as_posix()
                out.append(FileEntry(rel, st.st_size, stat.S_IMODE(st.st_mode)))
    return sorted(out, key=lambda f: f.path)


def data_chunks(path: Path, size: int) -> Iterator[int]:
    """Offsets of the chunks of a file that hold data; holes are skipped without reading."""
    with open(path, "rb") as f:
        fd, offset = f.fileno(), 0
        while offset < size:
            try:
                data = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: nothing but a hole from here on
                return
            offset = data - data % CHUNK
            yield offset
            offset += CHUNK


def read_chunk(path: Path, offset: int, length: int) -> bytes | None:
    """The chunk, None if it is all zeros."""
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), length, offset)
    return None if data == _ZEROS[: len(data)] else data


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def config(kind: str, files: list[FileEntry], meta: dict[str, Any]) -> bytes:
    body = {"kind": kind, "meta": meta,
            "files": [{"path": f.path, "size": f.size, "mode": f.mode} for f in files]}  # fmt: skip
    return json.dumps(formats.stamp("bundle", body), sort_keys=True).encode()


def chunk_descriptor(digest: str, size: int, chunk: Chunk) -> dict[str, Any]:
    return {"mediaType": CHUNK_TYPE, "digest": digest, "size": size,
            "annotations": {"space.file": chunk.file, "space.offset": str(chunk.offset),
                            "space.length": str(chunk.length)}}  # fmt: skip


def manifest(config_blob: bytes, layers: list[dict[str, Any]], kind: str) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": oci.MEDIA_OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_TYPE, "digest": oci.sha256_digest(config_blob),
                   "size": len(config_blob)},
        "layers": layers,
        "annotations": {"space.kind": kind},
    }  # fmt: skip
    return json.dumps(doc, sort_keys=True).encode()


# --- reading a pulled bundle -------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    kind: str
    meta: dict[str, Any]
    files: list[FileEntry]
    chunks: list[tuple[oci.Descriptor, Chunk]]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def _relative(path: Any) -> str:
    if not isinstance(path, str) or not path or "\0" in path:
        raise ImageError(f"bundle: bad path {path!r}")
    parts = PurePosixPath(path).parts
    if PurePosixPath(path).is_absolute() or any(p in ("..", ".") for p in parts):
        raise ImageError(f"bundle: path {path!r} leaves its directory")
    return "/".join(parts)


def layout(config_blob: bytes, doc: oci.Manifest, kind: str) -> Layout:
    """What a pulled manifest and config say to write, checked."""
    try:
        body = json.loads(config_blob)
        formats.check("bundle", body, "bundle config")
        files = [FileEntry(_relative(f["path"]), int(f["size"]), int(f["mode"]) & 0o777)
                 for f in body["files"]]  # fmt: skip
        meta = dict(body.get("meta") or {})
        found = str(body["kind"])
    except formats.FormatError as e:
        raise ImageError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ImageError(f"bundle: its config does not parse: {e}") from None
    if found != kind:
        raise ImageError(f"bundle: it holds a {found}, not a {kind}")
    if len(files) > MAX_FILES or any(not 0 <= f.size <= MAX_FILE for f in files):
        raise ImageError("bundle: too many files, or a file too large")
    sizes = {f.path: f.size for f in files}
    if len(sizes) != len(files):
        raise ImageError("bundle: a file is listed twice")
    chunks = []
    for desc in doc.layers:
        a = desc.annotations
        try:
            chunk = Chunk(_relative(a["space.file"]), int(a["space.offset"]),
                          int(a["space.length"]))  # fmt: skip
        except (KeyError, ValueError) as e:
            raise ImageError(f"bundle: chunk {desc.digest} is not described: {e}") from None
        size = sizes.get(chunk.file)
        if (desc.media_type != CHUNK_TYPE or size is None or chunk.offset % CHUNK
                or not 0 < chunk.length <= CHUNK or chunk.offset + chunk.length > size
                or desc.size > MAX_BLOB):  # fmt: skip
            raise ImageError(f"bundle: chunk {desc.digest} does not fit its file")
        chunks.append((desc, chunk))
    return Layout(found, meta, files, chunks)


def prepare(root: Path, files: list[FileEntry]) -> None:
    """Every file made at its full size, all holes, under `root` (a new directory)."""
    for f in files:
        path = root / f.path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(path, "xb") as out:
            out.truncate(f.size)


def write_chunk(root: Path, chunk: Chunk, blob: bytes) -> None:
    try:  # read through a stream, so a frame that claims a huge size allocates nothing
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)) as reader:
            data = b""
            while len(data) <= CHUNK and (more := reader.read(CHUNK + 1 - len(data))):
                data += more
    except zstandard.ZstdError as e:
        raise ImageError(f"bundle: a chunk of {chunk.file} does not decompress: {e}") from None
    if len(data) != chunk.length:
        raise ImageError(f"bundle: a chunk of {chunk.file} is not {chunk.length} bytes long")
    fd = os.open(root / chunk.file, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        for start, end in _data_runs(data):  # zero blocks stay holes
            os.pwrite(fd, data[start:end], chunk.offset + start)
    finally:
        os.close(fd)


def _data_runs(data: bytes) -> Iterator[tuple[int, int]]:
    """(start, end) of the runs of BLOCK-sized blocks that are not all zeros."""
    view, start = memoryview(data), None
    for at in range(0, len(data), BLOCK):
        zero = view[at : at + BLOCK] == _ZEROS[: min(BLOCK, len(data) - at)]
        if zero and start is not None:
            yield start, at
            start = None
        elif not zero and start is None:
            start = at
    if start is not None:
        yield start, len(data)


def finish(root: Path, files: list[FileEntry]) -> None:
    for f in files:
        os.chmod(root / f.path, f.mode)

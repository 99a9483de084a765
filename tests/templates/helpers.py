"""Images made by the tests themselves, and a pusher for the registry HTTP API (httpx)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zstandard

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
LAYER_TYPES = {
    "none": "application/vnd.oci.image.layer.v1.tar",
    "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
    "zstd": "application/vnd.oci.image.layer.v1.tar+zstd",
}


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | hardlink
    data: bytes = b""
    target: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0


def file(name: str, data: bytes | str, mode: int = 0o644, uid: int = 0) -> Entry:
    return Entry(name, "file", data.encode() if isinstance(data, str) else data, mode=mode, uid=uid)


def directory(name: str, mode: int = 0o755) -> Entry:
    return Entry(name, "dir", mode=mode)


def symlink(name: str, target: str) -> Entry:
    return Entry(name, "symlink", target=target, mode=0o777)


def hardlink(name: str, target: str) -> Entry:
    return Entry(name, "hardlink", target=target)


def whiteout(path: str) -> Entry:
    parent, _, base = path.rpartition("/")
    return file(f"{parent}/.wh.{base}" if parent else f".wh.{base}", b"")


def opaque(directory_path: str) -> Entry:
    return file(f"{directory_path}/.wh..wh..opq", b"")


def tar_bytes(entries: list[Entry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.uid, info.gid, info.mtime = e.mode, e.uid, e.gid, 1_700_000_000
            if e.kind == "dir":
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.target
                tf.addfile(info)
            elif e.kind == "hardlink":
                info.type, info.linkname = tarfile.LNKTYPE, e.target
                tf.addfile(info)
            else:
                info.size = len(e.data)
                tf.addfile(info, io.BytesIO(e.data))
    return buf.getvalue()


def compress(data: bytes, how: str) -> bytes:
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(data)
    return data


@dataclass
class Image:
    """An image as blobs: layers (compressed as given), a config, a manifest."""

    layers: list[tuple[bytes, str]]  # (blob, media type)
    config: dict[str, Any] = field(default_factory=dict)
    docker: bool = False  # Docker schema 2 media types instead of OCI

    @property
    def config_blob(self) -> bytes:
        body = {
            "architecture": "amd64",
            "os": "linux",
            "config": self.config,
            "rootfs": {"type": "layers", "diff_ids": []},
        }
        return json.dumps(body).encode()

    @property
    def manifest(self) -> bytes:
        cfg = self.config_blob
        doc = {
            "schemaVersion": 2,
            "mediaType": DOCKER_MANIFEST if self.docker else OCI_MANIFEST,
            "config": {
                "mediaType": DOCKER_CONFIG if self.docker else OCI_CONFIG,
                "digest": digest(cfg),
                "size": len(cfg),
            },
            "layers": [
                {"mediaType": media, "digest": digest(blob), "size": len(blob)}
                for blob, media in self.layers
            ],
        }
        return json.dumps(doc).encode()

    @property
    def media_type(self) -> str:
        return DOCKER_MANIFEST if self.docker else OCI_MANIFEST

    def blobs(self) -> list[bytes]:
        return [blob for blob, _ in self.layers] + [self.config_blob]


def image(
    *layers: list[Entry], config: dict[str, Any] | None = None, compression: str = "gzip"
) -> Image:
    return Image(
        layers=[
            (compress(tar_bytes(entries), compression), LAYER_TYPES[compression])
            for entries in layers
        ],
        config=config or {},
    )


def index_of(manifests: list[tuple[bytes, str, str]]) -> bytes:
    """An OCI index over (manifest, os, arch)."""
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": digest(m),
                    "size": len(m),
                    "platform": {"os": os_name, "architecture": arch},
                }
                for m, os_name, arch in manifests
            ],
        }
    ).encode()


# --- pushing -----------------------------------------------------------------------------------


class Pusher:
    """Pushes with the registry API: monolithic blob uploads (POST, then PUT), manifest PUT."""

    def __init__(
        self, url: str, auth: tuple[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> None:
        self.url = url
        self.http = httpx.Client(auth=auth, headers=headers, timeout=60)

    def close(self) -> None:
        self.http.close()

    def blob(self, repo: str, data: bytes) -> None:
        d = digest(data)
        if self.http.head(f"{self.url}/v2/{repo}/blobs/{d}").status_code == 200:
            return
        r = self.http.post(f"{self.url}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = httpx.URL(self.url).join(r.headers["location"])
        r = self.http.put(
            location.copy_merge_params({"digest": d}),
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text

    def manifest(self, repo: str, ref: str, data: bytes, media_type: str) -> str:
        r = self.http.put(
            f"{self.url}/v2/{repo}/manifests/{ref}",
            content=data,
            headers={"Content-Type": media_type},
        )
        assert r.status_code == 201, r.text
        return digest(data)

    def push(self, repo: str, tag: str, img: Image) -> str:
        for blob in img.blobs():
            self.blob(repo, blob)
        return self.manifest(repo, tag, img.manifest, img.media_type)


# --- on disk -----------------------------------------------------------------------------------


def write_oci_layout(dest: Path, img: Image, tag: str = "latest") -> None:
    blobs = dest / "blobs/sha256"
    blobs.mkdir(parents=True)
    for blob in [*img.blobs(), img.manifest]:
        (blobs / digest(blob).removeprefix("sha256:")).write_bytes(blob)
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    m = img.manifest
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": OCI_MANIFEST,
                "digest": digest(m),
                "size": len(m),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    (dest / "index.json").write_text(json.dumps(index))


def write_docker_save(dest: Path, img: Image) -> None:
    """A `docker save` archive: manifest.json, <id>.json, <id>/layer.tar (uncompressed)."""
    cfg = img.config_blob
    cfg_name = digest(cfg).removeprefix("sha256:") + ".json"
    members: list[tuple[str, bytes]] = [(cfg_name, cfg)]
    layer_names = []
    for i, (blob, media) in enumerate(img.layers):
        raw = gzip.decompress(blob) if media.endswith("gzip") else blob
        name = f"{i:04d}{'0' * 60}/layer.tar"
        layer_names.append(name)
        members.append((name, raw))
    manifest = [{"Config": cfg_name, "RepoTags": ["test:latest"], "Layers": layer_names}]
    members.append(("manifest.json", json.dumps(manifest).encode()))
    with tarfile.open(dest, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))

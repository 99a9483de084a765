"""Bundles in a real registry (`space.worker.artifacts`): a directory pushed in chunks comes
back the same, sparse where it was, and a second push sends only what changed; a registry that
wants credentials gets them; a bundle that lies about its paths or chunks writes nothing."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from space.settings import RegistrySettings
from space.worker.artifacts import Artifacts, bundle
from space.worker.templates import oci
from space.worker.templates.errors import AuthenticationFailed, ImageError, RegistryError
from space.worker.templates.registry import ImageReference, RegistryClient

from ..templates.conftest import PASSWORD, USER, Registry

MiB = 1 << 20


def make_tree(root: Path) -> None:
    """A sparse 64 MiB disk with data in two places, a small file, and a private directory."""
    root.mkdir()
    disk = root / "rootfs.ext4"
    with open(disk, "wb") as f:
        f.truncate(64 * MiB)
        f.seek(3 * MiB)
        f.write(os.urandom(MiB))
        f.seek(40 * MiB + 5)
        f.write(b"the end of the middle")
    disk.chmod(0o444)
    (root / "template.json").write_text('{"name": "t"}\n')
    (root / "snapshot").mkdir(mode=0o700)
    (root / "snapshot" / "state").write_bytes(b"\x00" * 1000 + b"device state")
    (root / "snapshot" / "state").chmod(0o600)


def same(a: Path, b: Path) -> None:
    for f in bundle.files_of(a):
        assert (b / f.path).read_bytes() == (a / f.path).read_bytes(), f.path
        assert (b / f.path).stat().st_mode & 0o777 == f.mode, f.path
    assert {f.path for f in bundle.files_of(b)} == {f.path for f in bundle.files_of(a)}


def artifacts(reg: Registry, **kw: str) -> Artifacts:
    return Artifacts(RegistrySettings(url=f"{reg.host}/space", insecure=True, **kw))


def test_a_directory_comes_back_the_same_and_as_sparse(registry: Registry, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src)
    store = artifacts(registry)
    lines: list[str] = []
    pushed = asyncio.run(store.push("template", "t", "one", src, {"a": 1}, lines.append))
    # Two data chunks of the disk and one each for the small files; holes are not sent.
    assert (pushed.blobs, pushed.uploaded) == (4, 4)
    assert pushed.reference.startswith(f"{registry.host}/space/templates/t@sha256:")
    assert lines[0].startswith("pushing template t:") and "done in" in lines[-1]

    dest = tmp_path / "dest"
    plan = asyncio.run(store.pull(pushed.reference, "template", "t", dest))
    same(src, dest)
    assert plan.meta == {"a": 1}
    # Sparse: the 64 MiB disk holds about what was written into it.
    assert (dest / "rootfs.ext4").stat().st_blocks * 512 < 4 * MiB
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pull-")]

    # One chunk changed: only it is sent again.
    with open(src / "rootfs.ext4", "r+b") as f:
        f.seek(40 * MiB)
        f.write(b"changed")
    again = asyncio.run(store.push("template", "t", "two", src, {"a": 2}))
    assert (again.blobs, again.uploaded) == (4, 1)
    asyncio.run(store.pull(again.reference, "template", "t", tmp_path / "dest2"))
    same(src, tmp_path / "dest2")


def test_a_pull_asked_twice_at_once_is_made_once(registry: Registry, tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src)
    store = artifacts(registry)

    async def twice() -> None:
        pushed = await store.push("template", "twice", "one", src, {})
        dest = tmp_path / "dest"
        a, b = await asyncio.gather(*(store.pull(pushed.reference, "template", "twice", dest)
                                      for _ in range(2)))  # fmt: skip
        assert a is b

    asyncio.run(twice())
    same(src, tmp_path / "dest")


def test_a_registry_that_wants_credentials_gets_them(
    private_registry: Registry, token_registry: Registry, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    make_tree(src)
    for reg in (private_registry, token_registry):
        with pytest.raises(AuthenticationFailed):
            asyncio.run(artifacts(reg).push("volume", "v", "one", src, {}))
        store = artifacts(reg, username=USER, password=PASSWORD)
        pushed = asyncio.run(store.push("volume", "v", "one", src, {}))
        dest = tmp_path / f"dest-{reg.host.replace(':', '-')}"
        asyncio.run(store.pull(pushed.reference, "volume", "v", dest))
        same(src, dest)
        with pytest.raises(AuthenticationFailed):
            asyncio.run(artifacts(reg).pull(pushed.reference, "volume", "v", tmp_path / "nope"))
    assert not (tmp_path / "nope").exists()


async def _forged(reg: Registry, name: str, files: list[dict[str, object]],
                  chunks: list[tuple[bytes, dict[str, str]]]) -> str:  # fmt: skip
    """A bundle made by hand: what a registry that lies would give."""
    ref = ImageReference(reg.host, f"space/templates/{name}")
    async with RegistryClient(ref, insecure=True) as client:
        config = json.dumps({"kind": "template", "meta": {}, "files": files}).encode()
        await client.push_blob(config, oci.sha256_digest(config))
        layers = []
        for blob, annotations in chunks:
            digest = oci.sha256_digest(blob)
            await client.push_blob(blob, digest)
            layers.append({"mediaType": bundle.CHUNK_TYPE, "digest": digest, "size": len(blob),
                           "annotations": annotations})  # fmt: skip
        doc = bundle.manifest(config, layers, "template")
        digest = await client.push_manifest("forged", doc, oci.MEDIA_OCI_MANIFEST)
    return f"{reg.host}/space/templates/{name}@{digest}"


FORGERIES = {
    "a path out of its directory": (
        [{"path": "../escaped", "size": 10, "mode": 0o644}], []),
    "an absolute path": (
        [{"path": "/tmp/escaped", "size": 10, "mode": 0o644}], []),
    "a chunk past the end of its file": (
        [{"path": "f", "size": 10, "mode": 0o644}],
        [(bundle.compress(b"x" * 10), {"space.file": "f", "space.offset": "16777216",
                                        "space.length": "10"})]),
    "a chunk longer than it says": (
        [{"path": "f", "size": 10, "mode": 0o644}],
        [(bundle.compress(b"x" * 1000), {"space.file": "f", "space.offset": "0",
                                          "space.length": "10"})]),
    "a chunk of a file it does not list": (
        [{"path": "f", "size": 10, "mode": 0o644}],
        [(bundle.compress(b"x" * 10), {"space.file": "g", "space.offset": "0",
                                        "space.length": "10"})]),
    "a chunk that is no zstd frame": (
        [{"path": "f", "size": 10, "mode": 0o644}],
        [(b"not zstd at all", {"space.file": "f", "space.offset": "0", "space.length": "10"})]),
}  # fmt: skip


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_bundle_that_lies_writes_nothing(
    registry: Registry, tmp_path: Path, forgery: str
) -> None:
    files, chunks = FORGERIES[forgery]
    reference = asyncio.run(_forged(registry, "forged", files, chunks))
    dest = tmp_path / "pulls" / "dest"
    with pytest.raises(ImageError):
        asyncio.run(artifacts(registry).pull(reference, "template", "forged", dest))
    assert list((tmp_path / "pulls").iterdir()) == []
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()


def test_only_this_deployments_bundles_are_pulled(registry: Registry, tmp_path: Path) -> None:
    store = artifacts(registry)
    # A bundle pushed for one thing is never taken for another, even of the same kind.
    src = tmp_path / "src"
    make_tree(src)
    pushed = asyncio.run(store.push("sandbox", "sb-a", "one", src, {}))
    for kind, name in (("sandbox", "sb-b"), ("template", "sb-a")):
        with pytest.raises(ImageError, match="is not in"):
            asyncio.run(store.pull(pushed.reference, kind, name, tmp_path / "dest"))
    digest = "sha256:" + "0" * 64
    for reference in (f"elsewhere.example:5000/space/templates/t@{digest}",
                      f"{registry.host}/other/templates/t@{digest}",
                      f"{registry.host}/space/templates/t:latest"):  # fmt: skip
        with pytest.raises((RegistryError, ImageError)):
            asyncio.run(store.pull(reference, "template", "t", tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()

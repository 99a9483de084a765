"""Layers, whiteouts, path safety, image configs, layouts and archives (no registry, no VM)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from space.worker.templates import oci
from space.worker.templates.errors import DigestMismatch, NotBootable, UnsafeLayer
from space.worker.templates.rootfs import check_bootable, make_ext4
from space.worker.templates.sources import SourceRef, resolve_source
from tests.templates.helpers import (
    compress,
    digest,
    directory,
    file,
    hardlink,
    image,
    opaque,
    symlink,
    tar_bytes,
    whiteout,
    write_docker_save,
    write_oci_layout,
)


def apply(root: Path, entries: list, how: str = "none") -> int:  # type: ignore[type-arg]
    return oci.apply_layer(root, io.BytesIO(compress(tar_bytes(entries), how)), what="test")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    r.mkdir()
    return r


def test_whiteouts_and_opaque_directories(root: Path) -> None:
    apply(
        root,
        [
            directory("etc"),
            file("etc/a", "a"),
            file("etc/b", "b"),
            directory("opt/keep"),
            file("opt/keep/old1", "1"),
            file("opt/keep/old2", "2"),
            directory("var/x"),
            file("var/x/inside", "x"),
        ],
    )
    apply(
        root,
        [
            whiteout("etc/a"),
            file("opt/keep/before", "made before the marker, same layer"),
            opaque("opt/keep"),
            file("opt/keep/new", "new"),
            whiteout("var/x"),
        ],
        "gzip",
    )
    assert not (root / "etc/a").exists()
    assert (root / "etc/b").read_text() == "b"
    assert sorted(os.listdir(root / "opt/keep")) == ["before", "new"]
    assert not (root / "var/x").exists() and (root / "var").is_dir()
    # Markers themselves never land in the root.
    assert not [p for p in root.rglob(".wh.*")]


def test_modes_owners_links_and_zstd(root: Path) -> None:
    apply(
        root,
        [
            file("usr/bin/tool", "#!/bin/sh\n", mode=0o4755, uid=1000),
            symlink("bin", "usr/bin"),
            hardlink("usr/bin/tool2", "usr/bin/tool"),
        ],
        "zstd",
    )
    st = (root / "usr/bin/tool").stat()
    assert st.st_mode & 0o7777 == 0o4755 and st.st_uid == 1000
    assert os.readlink(root / "bin") == "usr/bin"
    assert (root / "bin/tool").read_text() == "#!/bin/sh\n"
    assert (root / "usr/bin/tool2").stat().st_ino == st.st_ino


def test_path_traversal_is_refused(tmp_path: Path, root: Path) -> None:
    with pytest.raises(UnsafeLayer, match=r"climbs out of the root"):
        apply(root, [file("../evil", "x")])
    with pytest.raises(UnsafeLayer):
        apply(root, [file("etc/../../evil2", "x")])
    with pytest.raises(UnsafeLayer):
        apply(root, [hardlink("h", "../../etc/shadow")])
    assert not (tmp_path / "evil").exists() and not (tmp_path / "evil2").exists()


def test_symlinks_cannot_escape_the_root(tmp_path: Path, root: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    apply(
        root,
        [
            symlink("abs", str(outside)),  # absolute: means <root>/<outside> in the image
            symlink("up", "../../../../.."),  # relative climbing: stops at the root
            symlink("victim", str(victim)),
        ],
    )
    apply(
        root,
        [
            file("abs/pwned", "x"),
            file("up/pwned2", "y"),
            file("victim", "replaced"),  # replaces the link; never writes through it
        ],
    )
    assert list(outside.iterdir()) == []
    assert victim.read_text() == "untouched"
    assert (root / str(outside).lstrip("/") / "pwned").read_text() == "x"
    assert (root / "pwned2").read_text() == "y"
    assert not (root / "victim").is_symlink() and (root / "victim").read_text() == "replaced"
    assert not (tmp_path / "pwned2").exists()


def test_digest_is_checked(root: Path) -> None:
    blob = compress(tar_bytes([file("a", "a")]), "gzip")
    oci.apply_layer(root, io.BytesIO(blob), what="ok", digest=digest(blob))
    with pytest.raises(DigestMismatch):
        oci.apply_layer(root, io.BytesIO(blob), what="bad", digest="sha256:" + "0" * 64)


def test_image_config_is_parsed() -> None:
    cfg = oci.ImageConfig.from_json(
        {
            "config": {
                "Env": ["PATH=/usr/bin:/bin", "GREETING=hi=there"],
                "WorkingDir": "/app",
                "Entrypoint": ["/entry.sh"],
                "Cmd": ["serve", "--port", "80"],
                "User": "1000:1000",
            }
        }
    )
    assert cfg.env == {"PATH": "/usr/bin:/bin", "GREETING": "hi=there"}
    assert (cfg.workdir, cfg.user) == ("/app", "1000:1000")
    assert cfg.entrypoint == ["/entry.sh"] and cfg.cmd == ["serve", "--port", "80"]
    assert oci.ImageConfig.from_json({"config": {}}).env["PATH"].startswith("/usr/local")


TEST_IMAGE = image(
    [directory("etc"), file("etc/os-release", "ID=test\n"), file("etc/gone", "x")],
    [whiteout("etc/gone"), file("hello.txt", "hello\n")],
    config={"Env": ["A=1"], "Cmd": ["/bin/sh"]},
)


async def test_oci_layout_directory(tmp_path: Path, root: Path) -> None:
    write_oci_layout(tmp_path / "layout", TEST_IMAGE, tag="v1")
    src = await resolve_source(SourceRef.parse(f"oci-layout:{tmp_path / 'layout'}"), print)
    assert src.digest == digest(TEST_IMAGE.manifest)
    assert src.config.env == {"A": "1"} and src.config.cmd == ["/bin/sh"]
    await src.unpack(root, print)
    assert (root / "hello.txt").read_text() == "hello\n" and not (root / "etc/gone").exists()


async def test_oci_layout_tarball_with_tag(tmp_path: Path, root: Path) -> None:
    write_oci_layout(tmp_path / "layout", TEST_IMAGE, tag="v1")
    archive = tmp_path / "image.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(tmp_path / "layout", arcname=".")
    src = await resolve_source(SourceRef.parse(f"oci-archive:{archive}"), print)
    await src.unpack(root, print)
    assert (root / "etc/os-release").read_text() == "ID=test\n"


async def test_docker_save_archive(tmp_path: Path, root: Path) -> None:
    archive = tmp_path / "saved.tar"
    write_docker_save(archive, TEST_IMAGE)
    src = await resolve_source(SourceRef.parse(f"docker-archive:{archive}"), print)
    assert src.config.env == {"A": "1"}
    await src.unpack(root, print)
    assert (root / "hello.txt").exists() and not (root / "etc/gone").exists()


async def test_plain_directory_and_tarball(tmp_path: Path, root: Path) -> None:
    (tmp_path / "tree/etc").mkdir(parents=True)
    (tmp_path / "tree/etc/x").write_text("x")
    a = await resolve_source(SourceRef.parse(f"dir:{tmp_path / 'tree'}"), print)
    b = await resolve_source(SourceRef.parse(f"dir:{tmp_path / 'tree'}"), print)
    assert a.digest == b.digest
    (tmp_path / "tree/etc/x").write_text("changed")
    c = await resolve_source(SourceRef.parse(f"dir:{tmp_path / 'tree'}"), print)
    assert c.digest != a.digest
    await c.unpack(root, print)
    assert (root / "etc/x").read_text() == "changed"

    tarball = tmp_path / "root.tar.gz"
    tarball.write_bytes(compress(tar_bytes([file("srv/data", "d")]), "gzip"))
    t = await resolve_source(SourceRef.parse(f"tar:{tarball}"), print)
    await t.unpack(root, print)
    assert (root / "srv/data").read_text() == "d"


def test_bootable_needs_python3(tmp_path: Path, root: Path) -> None:
    apply(root, [file("bin/sh", "x", mode=0o755)])
    with pytest.raises(NotBootable, match=r"/usr/bin/python3"):
        check_bootable(root)
    # Links are followed inside the root, as the initramfs does.
    apply(
        root,
        [
            symlink("usr/bin/python3", "python3.11"),
            file("usr/bin/python3.11", "ELF", mode=0o755),
        ],
    )
    check_bootable(root)
    image_path = tmp_path / "rootfs.ext4"
    size = make_ext4(root, image_path, print)
    assert image_path.stat().st_size == size
    assert image_path.stat().st_blocks * 512 < size // 4  # sparse


def test_index_platform_choice() -> None:
    amd, arm = b'{"a":1}', b'{"b":2}'
    idx = oci.parse_document(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": oci.MEDIA_OCI_INDEX,
                "manifests": [
                    {
                        "digest": digest(arm),
                        "size": 7,
                        "platform": {"os": "linux", "architecture": "arm64"},
                    },
                    {
                        "digest": digest(amd),
                        "size": 7,
                        "platform": {"os": "linux", "architecture": "amd64"},
                    },
                ],
            }
        ).encode()
    )
    assert isinstance(idx, oci.Index)
    assert oci.choose_platform(idx).digest == digest(amd)
    with pytest.raises(oci.ImageError, match=r"offers: linux/amd64, linux/arm64"):
        oci.choose_platform(idx, arch="s390x")


def test_xattrs_from_pax_headers(root: Path) -> None:
    """File capabilities (security.capability) and the like travel as SCHILY.xattr.* headers."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo("usr/bin/ping")
        info.size, info.mode = 3, 0o755
        info.pax_headers = {"SCHILY.xattr.user.space-test": "kept"}
        tf.addfile(info, io.BytesIO(b"elf"))
    oci.apply_layer(root, io.BytesIO(buf.getvalue()), what="xattrs")
    try:
        value = os.getxattr(root / "usr/bin/ping", "user.space-test")
    except OSError as e:
        pytest.skip(f"this file system keeps no user xattrs: {e}")
    assert value == b"kept"

"""Pulls from a real registry (Debian's docker-registry on localhost), open and private."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from space.worker.templates.errors import AuthenticationFailed, ImageNotFound, RegistryError
from space.worker.templates.registry import (
    Credentials,
    ImageReference,
    RegistryClient,
    is_local_host,
)
from space.worker.templates.sources import SourceRef, resolve_source
from tests.templates.conftest import PASSWORD, USER, Registry
from tests.templates.helpers import (
    OCI_INDEX,
    digest,
    directory,
    file,
    image,
    index_of,
    opaque,
    whiteout,
)

IMG = image(
    [directory("app"), file("app/old", "old"), file("etc/motd", "one\n"), file("tmp/x", "x")],
    [opaque("app"), file("app/main.py", "print('hi')\n"), whiteout("tmp/x")],
    config={
        "Env": ["PATH=/usr/bin:/bin", "MODE=test"],
        "WorkingDir": "/app",
        "Entrypoint": ["python3", "main.py"],
        "User": "nobody",
    },
)


def test_references() -> None:
    r = ImageReference.parse("debian")
    assert (r.registry, r.repository, r.tag, r.api_host) == (
        "docker.io", "library/debian", "latest", "registry-1.docker.io"
    )  # fmt: skip
    r = ImageReference.parse("oci://localhost:5000/team/app:v1.2")
    assert (r.registry, r.repository, r.tag) == ("localhost:5000", "team/app", "v1.2")
    d = "sha256:" + "a" * 64
    r = ImageReference.parse(f"ghcr.io/org/img@{d}")
    assert (r.registry, r.repository, r.tag, r.digest, r.reference) == (
        "ghcr.io", "org/img", None, d, d
    )  # fmt: skip
    with pytest.raises(RegistryError, match="bad repository"):
        ImageReference.parse("localhost:5000/Upper")


async def test_pull_unpacks_layers_and_reads_config(registry: Registry, tmp_path: Path) -> None:
    manifest_digest = registry.pusher.push("space/app", "v1", IMG)
    src = await resolve_source(
        SourceRef.parse(f"oci://{registry.host}/space/app:v1"), print, insecure=True
    )
    assert src.digest == manifest_digest
    assert src.config.env == {"PATH": "/usr/bin:/bin", "MODE": "test"}
    assert (src.config.workdir, src.config.user) == ("/app", "nobody")
    assert src.config.entrypoint == ["python3", "main.py"]
    root = tmp_path / "root"
    root.mkdir()
    await src.unpack(root, print)
    assert sorted(p.name for p in (root / "app").iterdir()) == ["main.py"]
    assert (root / "etc/motd").read_text() == "one\n" and not (root / "tmp/x").exists()

    # Pinned by digest gives the same image.
    by_digest = await resolve_source(
        SourceRef.parse(f"oci://{registry.host}/space/app@{manifest_digest}"), print, insecure=True
    )
    assert by_digest.digest == manifest_digest


async def test_index_picks_linux_amd64(registry: Registry) -> None:
    arm = image([file("arch", "arm64")])
    amd = image([file("arch", "amd64")], compression="zstd")
    p = registry.pusher
    for img in (arm, amd):
        for blob in img.blobs():
            p.blob("space/multi", blob)
        p.manifest("space/multi", digest(img.manifest), img.manifest, img.media_type)
    p.manifest(
        "space/multi",
        "latest",
        index_of([(arm.manifest, "linux", "arm64"), (amd.manifest, "linux", "amd64")]),
        OCI_INDEX,
    )
    src = await resolve_source(
        SourceRef.parse(f"oci://{registry.host}/space/multi"), print, insecure=True
    )
    assert src.digest == digest(amd.manifest)


async def test_docker_schema2_manifest(registry: Registry, tmp_path: Path) -> None:
    img = image([file("d", "docker")], config={"Cmd": ["sh"]})
    img.docker = True
    registry.pusher.push("space/dockerish", "1", img)
    src = await resolve_source(
        SourceRef.parse(f"oci://{registry.host}/space/dockerish:1"), print, insecure=True
    )
    assert src.config.cmd == ["sh"]


async def test_unknown_image_and_tag(registry: Registry) -> None:
    registry.pusher.push("space/app", "v1", IMG)
    with pytest.raises(ImageNotFound, match=r"space/app:nope not found"):
        await resolve_source(
            SourceRef.parse(f"oci://{registry.host}/space/app:nope"), print, insecure=True
        )
    with pytest.raises(ImageNotFound, match=r"no-such-repo"):
        await resolve_source(
            SourceRef.parse(f"oci://{registry.host}/space/no-such-repo:v1"), print, insecure=True
        )


async def test_private_registry_needs_and_uses_credentials(
    private_registry: Registry, tmp_path: Path
) -> None:
    private_registry.pusher.push("secret/app", "v1", IMG)
    ref = SourceRef.parse(f"oci://{private_registry.host}/secret/app:v1")
    with pytest.raises(AuthenticationFailed, match="needs credentials"):
        await resolve_source(ref, print, insecure=True)
    with pytest.raises(AuthenticationFailed, match=r"refused the credentials of user 'alice'"):
        await resolve_source(ref, print, insecure=True, credentials=Credentials(USER, "wrong"))
    src = await resolve_source(ref, print, insecure=True, credentials=Credentials(USER, PASSWORD))
    root = tmp_path / "root"
    root.mkdir()
    await src.unpack(root, print)
    assert (root / "app/main.py").exists()


async def test_plain_http_needs_insecure_and_a_local_host(registry: Registry) -> None:
    with pytest.raises(RegistryError, match="insecure"):
        await resolve_source(SourceRef.parse(f"oci://{registry.host}/space/app:v1"), print)
    with pytest.raises(RegistryError, match="only allowed for registries on this host"):
        await resolve_source(
            SourceRef.parse("oci://registry.example.com/a:1"), print, insecure=True
        )
    for host in ("localhost:5000", "127.0.0.1:5000", "[::1]:5000", "10.1.2.3", "192.168.0.9:80"):
        assert is_local_host(host), host
    assert not is_local_host("8.8.8.8:5000") and not is_local_host("ghcr.io")


async def test_blob_digest_is_verified(registry: Registry) -> None:
    registry.pusher.push("space/app", "v1", IMG)
    async with RegistryClient(
        ImageReference.parse(f"{registry.host}/space/app:v1"), insecure=True
    ) as client:
        pulled = await client.pull_manifest()
        assert json.loads(await client.read_blob(pulled.manifest.config))["os"] == "linux"
        wrong = type(pulled.manifest.config)(
            media_type="x", digest="sha256:" + "1" * 64, size=pulled.manifest.config.size
        )
        with pytest.raises(ImageNotFound):
            await client.fetch_blob(wrong)


async def test_token_auth_registry(token_registry: Registry, tmp_path: Path) -> None:
    """Bearer tokens, as Docker Hub and most hosted registries hand them out."""
    # A layer no other test has: its blob must come through the token-authenticated download.
    nonce = uuid.uuid4().hex
    img = image([file("app/main.py", "print('hi')\n"), file("nonce", nonce)])
    token_registry.pusher.push("secret/app", "v1", img)
    ref = SourceRef.parse(f"oci://{token_registry.host}/secret/app:v1")
    with pytest.raises(AuthenticationFailed, match="needs credentials"):
        await resolve_source(ref, print, insecure=True)
    with pytest.raises(AuthenticationFailed, match="refused the credentials"):
        await resolve_source(ref, print, insecure=True, credentials=Credentials(USER, "nope"))
    src = await resolve_source(ref, print, insecure=True, credentials=Credentials(USER, PASSWORD))
    root = tmp_path / "root"
    root.mkdir()
    await src.unpack(root, print)
    assert (root / "app/main.py").read_text() == "print('hi')\n"
    assert (root / "nonce").read_text() == nonce

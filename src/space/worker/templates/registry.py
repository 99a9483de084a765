"""A client of the OCI distribution API (registry HTTP API v2): references, auth, pulls.

Auth follows what registries announce in `WWW-Authenticate` on a 401: `Bearer` (fetch a token
from the realm, with Basic credentials if we have some) or `Basic` (send the credentials). Plain
HTTP is used only when the caller says `insecure` (a registry on localhost in tests, say).
Blobs are verified against their sha256 digest and kept in a content-addressed cache, so the
layers of a second pull are not downloaded again.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import ipaddress
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from space.paths import cache_dir
from space.worker.templates import oci
from space.worker.templates.errors import (
    AuthenticationFailed,
    DigestMismatch,
    ImageNotFound,
    RegistryError,
)

DOCKER_HUB = "docker.io"
MAX_MANIFEST = 4 << 20  # the spec's limit for a manifest a registry must accept
DOCKER_HUB_API = "registry-1.docker.io"
REPOSITORY = re.compile(
    r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$"
)
_TAG = re.compile(r"^\w[\w.-]{0,127}$")


@dataclass(frozen=True)
class ImageReference:
    """`[registry/]repository[:tag][@digest]`, with Docker's defaults for the short forms."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> ImageReference:
        ref = text.strip()
        for scheme in ("oci://", "docker://"):
            ref = ref.removeprefix(scheme)
        name, _, digest = ref.partition("@")
        if digest:
            try:
                oci.check_digest(digest)
            except Exception:
                raise RegistryError(f"image reference {text!r}: bad digest {digest!r}") from None
        tag: str | None = None
        slash, colon = name.rfind("/"), name.rfind(":")
        if colon > slash:
            name, tag = name[:colon], name[colon + 1 :]
            if not _TAG.match(tag):
                raise RegistryError(f"image reference {text!r}: bad tag {tag!r}")
        first, sep, rest = name.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost"):
            registry, repository = first, rest
        else:
            registry, repository = DOCKER_HUB, name
            if "/" not in repository:
                repository = f"library/{repository}"
        if not REPOSITORY.match(repository):
            raise RegistryError(
                f"image reference {text!r}: bad repository name {repository!r} "
                "(lower-case letters, digits and . _ - / only)"
            )
        if tag is None and not digest:
            tag = "latest"
        return cls(registry=registry, repository=repository, tag=tag, digest=digest or None)

    @property
    def reference(self) -> str:
        """What to ask the manifests endpoint for: the digest if pinned, else the tag."""
        return self.digest or self.tag or "latest"

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)


@dataclass(frozen=True)
class PulledManifest:
    """An image as the registry described it, for linux/amd64."""

    ref: ImageReference
    digest: str  # of the platform manifest
    manifest: oci.Manifest
    config: oci.ImageConfig
    config_json: dict[str, Any]


def is_local_host(hostport: str) -> bool:
    """localhost, a Kubernetes Service of this cluster (`*.svc`, `*.svc.cluster.local`), or a
    loopback, private or link-local address (with or without a port)."""
    host = hostport
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost" or host.endswith((".localhost", ".svc", ".svc.cluster.local")):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_private or ip.is_link_local


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    params = dict(re.findall(r'(\w+)="([^"]*)"', rest))
    return scheme.lower(), params


def blob_cache() -> Path:
    return cache_dir() / "oci" / "blobs" / "sha256"


class RegistryClient:
    """One registry, one repository's pulls; `async with` closes its connections."""

    def __init__(
        self,
        ref: ImageReference,
        *,
        credentials: Credentials | None = None,
        insecure: bool = False,
        timeout: float = 60.0,
    ) -> None:
        self.ref = ref
        self.credentials = credentials
        self.insecure = insecure
        if insecure and not is_local_host(ref.api_host):
            # Plain HTTP would show credentials and images to the whole path to a remote host.
            raise RegistryError(
                f"registry {ref.registry}: plain HTTP (insecure) is only allowed for registries "
                "on this host, a private network address or a cluster Service (*.svc)"
            )
        scheme = "http" if insecure else "https"
        self.base = f"{scheme}://{ref.api_host}/v2/{ref.repository}"
        self._http = httpx.AsyncClient(timeout=timeout, follow_redirects=True)
        self._auth: str | None = None

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- requests and auth -------------------------------------------------------------------

    async def _send(
        self, method: str, url: str, headers: dict[str, str], stream: bool, content: bytes | None
    ) -> httpx.Response:
        if self._auth:
            headers = {**headers, "Authorization": self._auth}
        req = self._http.build_request(method, url, headers=headers, content=content)
        try:
            return await self._http.send(req, stream=stream)
        except httpx.HTTPError as e:
            hint = "" if self.insecure else " (a plain-HTTP registry needs `insecure = true`)"
            raise RegistryError(f"cannot reach registry {self.ref.registry}: {e}{hint}") from None

    async def _get(
        self, url: str, headers: dict[str, str] | None = None, stream: bool = False
    ) -> httpx.Response:
        return await self._request("GET", url, headers, stream=stream)

    async def _request(
        self, method: str, url: str, headers: dict[str, str] | None = None, *,
        stream: bool = False, content: bytes | None = None,
    ) -> httpx.Response:  # fmt: skip
        """The request, authenticated as the registry's challenge asks if it answers 401."""
        headers = headers or {}
        resp = await self._send(method, url, headers, stream, content)
        if resp.status_code != 401:
            return resp
        challenge = resp.headers.get("www-authenticate", "")
        await resp.aclose()
        await self._authenticate(challenge)
        resp = await self._send(method, url, headers, stream, content)
        if resp.status_code == 401:
            await resp.aclose()
            raise self._refused()
        return resp

    def _refused(self) -> AuthenticationFailed:
        if self.credentials is None:
            return AuthenticationFailed(
                f"registry {self.ref.registry} needs credentials for {self.ref.repository}; "
                "give a username and password"
            )
        return AuthenticationFailed(
            f"registry {self.ref.registry} refused the credentials of user "
            f"{self.credentials.username!r} for {self.ref.repository}"
        )

    def _basic(self) -> str:
        assert self.credentials is not None
        raw = f"{self.credentials.username}:{self.credentials.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    async def _authenticate(self, header: str) -> None:
        scheme, params = _challenge(header)
        if scheme == "basic":
            if self.credentials is None:
                raise self._refused()
            self._auth = self._basic()
        elif scheme == "bearer":
            realm = params.get("realm")
            if not realm:
                raise RegistryError(f"registry {self.ref.registry}: Bearer challenge has no realm")
            query = {"scope": params.get("scope") or f"repository:{self.ref.repository}:pull"}
            if params.get("service"):
                query["service"] = params["service"]
            headers = {"Authorization": self._basic()} if self.credentials else {}
            try:
                resp = await self._http.get(realm, params=query, headers=headers)
            except httpx.HTTPError as e:
                raise RegistryError(f"cannot reach the token service {realm}: {e}") from None
            if resp.status_code in (401, 403):
                raise self._refused()
            if resp.status_code != 200:
                raise RegistryError(f"token service {realm} answered HTTP {resp.status_code}")
            try:
                body = resp.json()
                token = body.get("token") or body.get("access_token")
            except (ValueError, AttributeError):
                token = None
            if not isinstance(token, str) or not token:
                raise RegistryError(f"token service {realm} gave no token")
            self._auth = f"Bearer {token}"
        else:
            raise RegistryError(
                f"registry {self.ref.registry} asks for unsupported auth {scheme or '(none)'!r}"
            )

    def _error(self, resp: httpx.Response, what: str) -> RegistryError:
        detail = ""
        with contextlib.suppress(ValueError, AttributeError, IndexError, KeyError, TypeError):
            first = resp.json()["errors"][0]
            detail = f" ({first.get('code')}: {first.get('message')})"
        if resp.status_code == 404:
            return ImageNotFound(
                f"image {self.ref} not found: registry {self.ref.registry} has no {what}{detail}"
            )
        if resp.status_code == 403:
            return AuthenticationFailed(f"registry {self.ref.registry} denied access to {what}")
        return RegistryError(
            f"registry {self.ref.registry} answered HTTP {resp.status_code} for {what}{detail}"
        )

    # --- manifests ---------------------------------------------------------------------------

    async def _document(self, reference: str) -> tuple[bytes, oci.Manifest | oci.Index, str]:
        resp = await self._get(
            f"{self.base}/manifests/{reference}", {"Accept": oci.ACCEPT}, stream=True
        )
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise self._error(resp, f"manifest {self.ref.repository}:{reference}")
            got = bytearray()
            async for chunk in resp.aiter_bytes():
                got += chunk
                if len(got) > MAX_MANIFEST:
                    raise RegistryError(f"manifest {reference} of {self.ref} is over 4 MiB")
        except httpx.HTTPError as e:
            raise RegistryError(f"download of manifest {reference} broke off: {e}") from None
        finally:
            await resp.aclose()
        data = bytes(got)
        digest = oci.sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatch(f"manifest {reference} of {self.ref} hashes to {digest}")
        return data, oci.parse_document(data, resp.headers.get("content-type")), digest

    async def pull_manifest(self) -> PulledManifest:
        """The linux/amd64 manifest of the image and its config."""
        _, doc, digest = await self._document(self.ref.reference)
        if isinstance(doc, oci.Index):
            chosen = oci.choose_platform(doc)
            _, doc, digest = await self._document(chosen.digest)
            if isinstance(doc, oci.Index):
                raise RegistryError(f"image {self.ref}: an index points at another index")
        config_bytes = await self.read_blob(doc.config)
        try:
            config_json = json.loads(config_bytes)
        except ValueError as e:
            raise RegistryError(f"image {self.ref}: the config blob is not JSON: {e}") from None
        return PulledManifest(
            ref=self.ref,
            digest=digest,
            manifest=doc,
            config=oci.ImageConfig.from_json(config_json),
            config_json=config_json,
        )

    # --- blobs -------------------------------------------------------------------------------

    async def read_blob(self, desc: oci.Descriptor) -> bytes:
        path = await self.fetch_blob(desc)
        return path.read_bytes()

    async def fetch_blob(self, desc: oci.Descriptor) -> Path:
        """The blob's file in the local blob cache, downloaded and verified unless there."""
        oci.check_digest(desc.digest)
        dest = blob_cache() / desc.digest.removeprefix("sha256:")
        if dest.is_file() and dest.stat().st_size == desc.size:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
        h = hashlib.sha256()
        size = 0
        try:
            resp = await self._get(f"{self.base}/blobs/{desc.digest}", stream=True)
            try:
                if resp.status_code != 200:
                    await resp.aread()
                    raise self._error(resp, f"blob {desc.digest}")
                with tmp.open("wb") as f:
                    async for chunk in resp.aiter_bytes(1 << 20):
                        h.update(chunk)
                        size += len(chunk)
                        f.write(chunk)
            except httpx.HTTPError as e:
                raise RegistryError(f"download of blob {desc.digest} broke off: {e}") from None
            finally:
                await resp.aclose()
            got = "sha256:" + h.hexdigest()
            if got != desc.digest:
                raise DigestMismatch(f"blob {desc.digest} of {self.ref} hashes to {got}")
            if size != desc.size:
                raise DigestMismatch(f"blob {desc.digest}: {size} bytes, manifest says {desc.size}")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    async def read_verified(self, desc: oci.Descriptor, limit: int) -> bytes:
        """A blob of at most `limit` bytes, in memory and checked against its digest; nothing
        is kept on disk."""
        oci.check_digest(desc.digest)
        if desc.size > limit:
            raise RegistryError(f"blob {desc.digest} is {desc.size} bytes, over {limit}")
        resp = await self._get(f"{self.base}/blobs/{desc.digest}", stream=True)
        try:
            if resp.status_code != 200:
                await resp.aread()
                raise self._error(resp, f"blob {desc.digest}")
            data = bytearray()
            async for chunk in resp.aiter_bytes(1 << 20):
                data += chunk
                if len(data) > desc.size:
                    raise DigestMismatch(f"blob {desc.digest}: more than {desc.size} bytes")
        except httpx.HTTPError as e:
            raise RegistryError(f"download of blob {desc.digest} broke off: {e}") from None
        finally:
            await resp.aclose()
        if oci.sha256_digest(bytes(data)) != desc.digest:
            raise DigestMismatch(f"blob {desc.digest} of {self.ref} does not hash to its digest")
        return bytes(data)

    # --- pushes ------------------------------------------------------------------------------

    async def has_blob(self, digest: str) -> bool:
        resp = await self._request("HEAD", f"{self.base}/blobs/{digest}")
        await resp.aclose()
        return resp.status_code == 200

    async def push_blob(self, data: bytes, digest: str) -> bool:
        """Upload a blob unless the repository has it (then False): a session, then one PUT."""
        if await self.has_blob(digest):
            return False
        resp = await self._request("POST", f"{self.base}/blobs/uploads/")
        if resp.status_code != 202 or "location" not in resp.headers:
            raise self._error(resp, "an upload session")
        location_url = resp.url.join(resp.headers["location"])
        if (location_url.scheme, location_url.netloc) != (resp.url.scheme, resp.url.netloc):
            # Its credentials go to the registry alone, never where an answer points.
            raise RegistryError(f"registry {self.ref.registry} sent the upload elsewhere")
        location = str(location_url)
        sep = "&" if "?" in location else "?"
        resp = await self._request(
            "PUT", f"{location}{sep}digest={digest}",
            {"Content-Type": "application/octet-stream"}, content=data,
        )  # fmt: skip
        if resp.status_code != 201:
            raise self._error(resp, f"the upload of blob {digest}")
        return True

    async def push_manifest(self, reference: str, data: bytes, media_type: str) -> str:
        """Put a manifest under a tag (or its digest); its digest."""
        resp = await self._request(
            "PUT", f"{self.base}/manifests/{reference}", {"Content-Type": media_type}, content=data
        )
        if resp.status_code != 201:
            raise self._error(resp, f"the manifest {self.ref.repository}:{reference}")
        return oci.sha256_digest(data)

    async def digest_of(self, tag: str) -> str | None:
        """The digest of the manifest tagged `tag`; None if there is none."""
        try:
            _, _, digest = await self._document(tag)
        except ImageNotFound:
            return None
        return digest

    async def document(self, digest: str) -> oci.Manifest:
        """The manifest pinned by `digest`."""
        _, doc, _ = await self._document(digest)
        if not isinstance(doc, oci.Manifest):
            raise RegistryError(f"{self.ref.repository}@{digest} is an index, not a manifest")
        return doc

    async def delete_manifest(self, digest: str) -> None:
        resp = await self._request("DELETE", f"{self.base}/manifests/{digest}")
        await resp.aclose()
        if resp.status_code not in (202, 404):
            raise self._error(resp, f"the deletion of {self.ref.repository}@{digest}")

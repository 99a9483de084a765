"""envd's plain HTTP: `GET /files` (a file's bytes), `POST /files` (one file as the raw body,
gzip or not, or several as multipart parts named `file` whose file names are their paths),
and `GET /health` (204 while the sandbox runs, 502 when it does not, which the SDKs read as
"not running")."""

from __future__ import annotations

import posixpath
import re
import zlib
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import replace
from typing import Annotated, Any

from connectrpc.errors import ConnectError
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from space.api.data import relay
from space.api.data import target as running
from space.api.deps import Svc
from space.api.errors import APIError
from space.db.store import NotFound
from space.e2b import tokens
from space.e2b.envd.target import USER, Target, errors, resolve

router = APIRouter(prefix="/envd", tags=["e2b"])

CHUNK = 1 << 20
MAX_PARTS = 16  # each held in memory up to 1 MiB before it spools
Path = Annotated[str | None, Query(max_length=4096, pattern=r"^[^\x00]*$")]
Username = Annotated[str | None, Query(max_length=32, pattern=USER.pattern)]
EXPIRATION = re.compile(r"^[0-9]{1,12}$")
METADATA_HEADER = "x-metadata-"


async def _target(
    svc: Svc, request: Request, path: str | None, username: str | None, operation: str
) -> Target:
    """Opened by the access token, or without it by the URL's signature (`download_url`,
    `upload_url`: a link for whoever holds it, until its `signature_expiration`)."""
    try:
        if "signature" in request.query_params and "x-access-token" not in request.headers:
            t = await _signed(svc, request, path, username, operation)
        else:
            t = await resolve(svc, request.headers)
    except ConnectError as e:  # this is plain HTTP: its status, not a Connect code
        status = {"unauthenticated": 401, "unavailable": 502, "not_found": 404,
                  "resource_exhausted": 429, "internal": 500}  # fmt: skip
        raise APIError(status.get(e.code.value, 400), e.message) from None
    return replace(t, user=username or t.user)  # /files names its user in the query


async def _signed(
    svc: Svc, request: Request, path: str | None, username: str | None, operation: str
) -> Target:
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    if not sandbox_id:
        # The SDK signs a URL of the daemon's own host name (E2B_DOMAIN); at E2B_SANDBOX_URL
        # nothing in it says which sandbox.
        raise APIError(400, "a signed URL names its sandbox by the daemon's host name "
                            "(49983-{sandbox}.{domain}, E2B_DOMAIN) or E2b-Sandbox-Id")  # fmt: skip
    if not path:
        # Without one, a write's parts would choose their own paths: a link is for one file.
        raise APIError(400, "a signed URL names its file: ?path=")
    raw = request.query_params.get("signature_expiration")
    if raw is not None and not EXPIRATION.fullmatch(raw):
        raise APIError(400, "signature_expiration is unix seconds")
    with errors():
        tenant = await tokens.signer(
            svc, sandbox_id, operation, path, username or "",
            request.query_params["signature"], int(raw) if raw is not None else None,
        )  # fmt: skip
        worker = await running(svc, tenant.id, sandbox_id)
    return Target(svc, tenant.id, sandbox_id, worker, username)


def written(path: str) -> dict[str, Any]:
    return {"name": posixpath.basename(path), "type": "file", "path": path}


@router.get("/files", response_class=StreamingResponse)
async def download(
    request: Request, svc: Svc, path: Path = None, username: Username = None
) -> StreamingResponse:
    t = await _target(svc, request, path, username, "read")
    full = t.path(path or "")
    return await relay(svc.workers.download(t.worker, t.sandbox_id, full),
                       "application/octet-stream")  # fmt: skip


@router.post("/files")
async def upload(
    request: Request, svc: Svc, path: Path = None, username: Username = None
) -> list[dict[str, Any]]:
    t = await _target(svc, request, path, username, "write")
    if any(name.lower().startswith(METADATA_HEADER) for name in request.headers):
        # Kept as extended attributes under envd; the guest agent keeps none yet, and a write
        # that dropped them would answer as if it had.
        raise APIError(400, "file metadata (X-Metadata-* headers) is not supported by SPACE yet")
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        return await _parts(t, request, path)
    if not path:
        raise APIError(400, "a raw upload names its file: ?path=")
    gzipped = request.headers.get("content-encoding", "").lower() == "gzip"
    body = _gunzip(request.stream()) if gzipped else request.stream()
    full = t.path(path)
    await svc.workers.upload(t.worker, t.sandbox_id, full, body, make_parents=True)
    return [written(full)]


async def _parts(t: Target, request: Request, path: str | None) -> list[dict[str, Any]]:
    """Each part named `file` to the path its file name gives (or `?path=` for one part)."""
    async with request.form(max_files=MAX_PARTS, max_fields=1) as form:
        files = [f for f in form.getlist("file") if isinstance(f, UploadFile)]
        if not files:
            raise APIError(400, "no part named 'file' in the form")
        if path and len(files) > 1:
            raise APIError(400, "?path= names one file, but the form has several")
        out = []
        for f in files:
            name = path or f.filename
            if not name:
                raise APIError(400, "a part has no file name to write it to")
            full = t.path(name)
            await t.svc.workers.upload(t.worker, t.sandbox_id, full, _read(f), make_parents=True)
            out.append(written(full))
        return out


async def _read(f: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await f.read(CHUNK):
        yield chunk


async def _gunzip(stream: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The body unzipped as it arrives (never whole in memory; the sandbox's disk bounds it)."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        async for chunk in stream:
            while chunk:
                yield inflate.decompress(chunk, CHUNK)
                chunk = inflate.unconsumed_tail
        yield inflate.flush()
    except zlib.error as e:
        raise APIError(400, f"the body is not valid gzip: {e}") from None
    if not inflate.eof or inflate.unused_data:
        raise APIError(400, "the body is not one whole gzip stream")


@router.get("/health", status_code=204)
async def health(request: Request, svc: Svc) -> Response:
    sandbox_id = request.headers.get("e2b-sandbox-id", "")
    who = await tokens.holder(svc, request.headers.get("x-access-token", ""), sandbox_id)
    try:
        row = await svc.store.get_sandbox(sandbox_id, who.id)
    except NotFound:
        row = None
    if row is None or row["state"] != "running":
        raise APIError(502, f"sandbox {sandbox_id} was not found running")
    return Response(status_code=204)

"""The web console at /console: a page and its bundled assets, served by the API itself.

It signs in with an API key kept in the browser tab (sessionStorage) and sends it as a bearer
token on every call, exactly as any client does: no cookie is set or read, so the console adds
no ambient authority (nothing for a cross-site request to ride on) and no CORS is opened. The
page gets a strict Content-Security-Policy with a fresh nonce per answer: scripts and styles
only from here (and the nonce, for the <style> elements xterm.js writes), connections only to
here, no frames, forms, plugins or base changes.
"""

from __future__ import annotations

import json
import secrets
from functools import cache

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from space.api.errors import APIError
from space.console import STATIC

router = APIRouter(include_in_schema=False)

TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
COMMON = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


def policy(nonce: str) -> str:
    return "; ".join([
        "default-src 'none'",
        f"script-src 'self' 'nonce-{nonce}'",
        f"style-src 'self' 'nonce-{nonce}'",
        "img-src 'self' data: blob:",
        "font-src 'self'",
        "connect-src 'self'",  # the API, its WebSockets included
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ])  # fmt: skip


@cache
def _assets() -> dict[str, bytes]:
    """The built files by name: only what the build wrote is ever served."""
    manifest = json.loads((STATIC / "manifest.json").read_text())
    return {name: (STATIC / name).read_bytes() for name in manifest["outputs"]}


@router.get("/console")
async def console_root() -> Response:
    return RedirectResponse("console/", status_code=308)


@router.get("/console/")
async def console_page() -> Response:
    nonce = secrets.token_urlsafe(18)
    page = _assets()["index.html"].replace(b"__NONCE__", nonce.encode())
    headers = {**COMMON, "Content-Security-Policy": policy(nonce), "Cache-Control": "no-store"}
    return Response(page, media_type="text/html; charset=utf-8", headers=headers)


@router.get("/console/assets/{name}")
async def console_asset(name: str) -> Response:
    body = _assets().get(name)
    kind = TYPES.get(name[name.rfind(".") :]) if "." in name else None
    if body is None or kind is None:
        raise APIError(404, f"no console asset {name!r}")
    # Named by their content's hash: a new build has new names.
    headers = {**COMMON, "Cache-Control": "public, max-age=31536000, immutable"}
    return Response(body, media_type=kind, headers=headers)

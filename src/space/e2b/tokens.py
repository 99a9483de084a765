"""The tokens an E2B SDK sends in place of the API key, which it never sends to a sandbox: the
envd access token (`X-Access-Token`, to its daemon) and the traffic access token
(`E2B-Traffic-Access-Token`, to the sandbox's ports: the code interpreter's among them).

Neither is the other, nor a preview link; each names the API key that made it, so revoking the
key ends it at once, and its sandbox, so it opens no other. The daemon's is a code of the key
and the sandbox under the deployment's key (the same at every create and connect), so that a
file URL the SDK signed with it (`download_url`, `upload_url`) can be checked by making it
again; the traffic token is a grant sealed with an end, fresh each time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

from space.api.deps import Services, admit
from space.api.errors import APIError
from space.api.grants import ANY_PORT, MAX_TOKEN, Grant
from space.db.sealing import Sealer, SealError
from space.db.store import NotFound, Tenant
from space.e2b import ENVD_PORT

CONTEXT = "envd access"
TRAFFIC = "traffic access"
TRAFFIC_HEADER = "e2b-traffic-access-token"
LIFETIME_S = 30 * 24 * 3600  # of a traffic token
DAEMON = "e2b1"  # what a daemon token starts with
KEY_ID = re.compile(r"^[A-Za-z0-9-]{1,64}$")
SIGNATURE = re.compile(r"^v1_[A-Za-z0-9+/]{43}$")  # base64 of a SHA-256, unpadded
MAX_SIGNING_KEYS = 100  # of a tenant, tried for a signed URL


def issue(svc: Services, who: Tenant, sandbox_id: str, context: str = CONTEXT) -> str:
    """A token for the daemon (`CONTEXT`) or for every port of the sandbox (`TRAFFIC`)."""
    if who.key_id is None:
        raise APIError(403, "only a call made with an API key can be given an E2B token")
    if context == CONTEXT:
        return daemon_token(svc.sealer, who.key_id, sandbox_id)
    grant = Grant(who.key_id, sandbox_id, ANY_PORT, int(time.time()) + LIFETIME_S)
    return grant.seal(svc.sealer, context)


def daemon_token(sealer: Sealer, key_id: str, sandbox_id: str, kid: str | None = None) -> str:
    kid, code = sealer.mac(f"{key_id}\0{sandbox_id}".encode(), CONTEXT, kid)
    return f"{DAEMON}.{kid}.{key_id}.{base64.urlsafe_b64encode(code).decode().rstrip('=')}"


def _daemon_key(sealer: Sealer, token: str, sandbox_id: str) -> str | None:
    """The API key a daemon token was given to, if it is one for this sandbox."""
    if len(token) > MAX_TOKEN:
        return None
    # The code and the API key's id hold no dot; the deployment key's id may.
    parts = token.removeprefix(f"{DAEMON}.").rsplit(".", 2)
    if len(parts) != 3 or not 0 < len(parts[0]) <= 64 or not KEY_ID.fullmatch(parts[1]):
        return None
    kid, key_id = parts[0], parts[1]
    try:
        expected = daemon_token(sealer, key_id, sandbox_id, kid)
    except SealError:
        return None
    return key_id if hmac.compare_digest(expected.encode(), token.encode()) else None


async def holder(
    svc: Services, token: str, sandbox_id: str, context: str = CONTEXT, port: int = ENVD_PORT
) -> Tenant:
    """The tenant a token speaks for, if it opens this port of this sandbox (401 otherwise)."""
    key_id = None
    if context == CONTEXT and token.startswith(f"{DAEMON}."):
        key_id = _daemon_key(svc.sealer, token, sandbox_id)
    elif token:  # a traffic token, or a daemon token of an earlier release (sealed, with an end)
        grant = Grant.open(svc.sealer, token, context)
        key_id = grant.key_id if grant is not None and grant.opens(sandbox_id, port) else None
    if key_id is None:
        header = "X-Access-Token" if context == CONTEXT else "E2B-Traffic-Access-Token"
        raise APIError(401, f"missing or invalid {header} for this sandbox")
    return await _tenant_of(svc, key_id)


async def _tenant_of(svc: Services, key_id: str) -> Tenant:
    tenant = await svc.store.tenant_of_key(key_id)
    if tenant is None:
        raise APIError(401, "the API key this token was given to was revoked")
    return admit(svc, tenant)


def url_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's signature of a file URL, made with the daemon token."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


async def signer(
    svc: Services, sandbox_id: str, operation: str, path: str, user: str, signature: str,
    expiration: int | None,
) -> Tenant:  # fmt: skip
    """The tenant whose daemon token signed this file URL (401 if none did, or it expired):
    the signature is made again with the token of each of the sandbox's tenant's keys, under
    each configured deployment key (a token made before a rotation still signs)."""
    if not SIGNATURE.fullmatch(signature):
        raise APIError(401, "a signature is v1_ and the base64 of a SHA-256")
    if expiration is not None and expiration < time.time():
        raise APIError(401, "this signed URL has expired")
    try:
        owner = (await svc.store.get_sandbox(sandbox_id))["tenant_id"]
    except NotFound:
        owner = None
    keys = await svc.store.active_key_ids(owner, MAX_SIGNING_KEYS) if owner else []
    for key_id in keys:
        for kid in svc.sealer.key_ids():
            token = daemon_token(svc.sealer, key_id, sandbox_id, kid)
            made = url_signature(path, operation, user, token, expiration)
            if hmac.compare_digest(made.encode(), signature.encode()):
                return await _tenant_of(svc, key_id)
    raise APIError(401, "invalid signature for this sandbox, path, user and operation")

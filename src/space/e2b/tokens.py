"""The tokens an E2B SDK sends in place of the API key, which it never sends to a sandbox: the
envd access token (`X-Access-Token`, to its daemon) and the traffic access token
(`E2B-Traffic-Access-Token`, to the sandbox's ports: the code interpreter's among them).

Each is a grant sealed for its use alone (neither is the other, nor a preview link): it names
the API key that made it, so revoking the key ends it at once, the sandbox, so it opens no
other, and an end. Every create and connect gives fresh ones.
"""

from __future__ import annotations

import time

from space.api.deps import Services, admit
from space.api.errors import APIError
from space.api.grants import ANY_PORT, Grant
from space.db.store import Tenant
from space.e2b import ENVD_PORT

CONTEXT = "envd access"
TRAFFIC = "traffic access"
TRAFFIC_HEADER = "e2b-traffic-access-token"
LIFETIME_S = 30 * 24 * 3600


def issue(svc: Services, who: Tenant, sandbox_id: str, context: str = CONTEXT) -> str:
    """A token for the daemon (`CONTEXT`) or for every port of the sandbox (`TRAFFIC`)."""
    if who.key_id is None:
        raise APIError(403, "only a call made with an API key can be given an E2B token")
    port = ENVD_PORT if context == CONTEXT else ANY_PORT
    grant = Grant(who.key_id, sandbox_id, port, int(time.time()) + LIFETIME_S)
    return grant.seal(svc.sealer, context)


async def holder(
    svc: Services, token: str, sandbox_id: str, context: str = CONTEXT, port: int = ENVD_PORT
) -> Tenant:
    """The tenant a token speaks for, if it opens this port of this sandbox (401 otherwise)."""
    grant = Grant.open(svc.sealer, token, context) if token else None
    if grant is None or not grant.opens(sandbox_id, port):
        header = "X-Access-Token" if context == CONTEXT else "E2B-Traffic-Access-Token"
        raise APIError(401, f"missing or invalid {header} for this sandbox")
    tenant = await svc.store.tenant_of_key(grant.key_id)
    if tenant is None:
        raise APIError(401, "the API key this token was given to was revoked")
    return admit(svc, tenant)

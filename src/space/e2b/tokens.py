"""envd access tokens: what an E2B SDK sends its sandbox's daemon (`X-Access-Token`) in place
of the API key, which it never sends there.

A token is a grant sealed for this use alone (a preview link is not one, nor the other way
round): it names the API key that made it, so revoking the key ends it at once, the sandbox,
so it opens no other, and an end. Every create and connect gives a fresh one.
"""

from __future__ import annotations

import time

from space.api.deps import Services, admit
from space.api.errors import APIError
from space.api.previews import Grant
from space.db.store import Tenant
from space.e2b import ENVD_PORT

CONTEXT = "envd access"
LIFETIME_S = 30 * 24 * 3600


def issue(svc: Services, who: Tenant, sandbox_id: str) -> str:
    if who.key_id is None:
        raise APIError(403, "only a call made with an API key can be given an envd token")
    grant = Grant(who.key_id, sandbox_id, ENVD_PORT, int(time.time()) + LIFETIME_S)
    return grant.seal(svc.sealer, CONTEXT)


async def holder(svc: Services, token: str, sandbox_id: str) -> Tenant:
    """The tenant a token speaks for, if it opens this sandbox (401 otherwise)."""
    grant = Grant.open(svc.sealer, token, CONTEXT) if token else None
    if grant is None or not grant.opens(sandbox_id, ENVD_PORT):
        raise APIError(401, "missing or invalid X-Access-Token for this sandbox")
    tenant = await svc.store.tenant_of_key(grant.key_id)
    if tenant is None:
        raise APIError(401, "the API key this token was given to was revoked")
    return admit(svc, tenant)

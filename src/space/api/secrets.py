"""Secret routes: a tenant's credentials, sealed at rest; a value goes in and never comes out.

Sandboxes use them by binding (`secrets` at create): the worker's gateway adds them to requests
to the hosts they are bound to, and the guest sees at most a placeholder.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Response

from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.schemas import SecretInfo, SecretList, SecretPut

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@router.put("/{name}", response_model=SecretInfo)
async def put_secret(name: str, body: SecretPut, svc: Svc, caller: Caller) -> SecretInfo:
    """Create or replace; sandboxes started from now on use the new value."""
    if not NAME.match(name):
        raise APIError(400, f"secret name {name!r} must match {NAME.pattern}")
    row = await svc.store.put_secret(caller.id, name, body.value, svc.sealer)
    return SecretInfo.model_validate(dict(row))


@router.get("", response_model=SecretList)
async def list_secrets(svc: Svc, caller: Caller) -> SecretList:
    rows = await svc.store.secrets(caller.id)
    return SecretList(items=[SecretInfo.model_validate(dict(r)) for r in rows])


@router.delete("/{name}", status_code=204)
async def delete_secret(name: str, svc: Svc, caller: Caller) -> Response:
    """Refused (409) while a sandbox that is not deleted has it bound."""
    await svc.store.delete_secret(caller.id, name)
    return Response(status_code=204)

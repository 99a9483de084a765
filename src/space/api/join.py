"""Workers joining the deployment: a one-time join token (`space admin join-token`) traded for
the worker's own certificate from the worker CA. The token is the only credential: a worker
has no API key."""

from __future__ import annotations

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field

from space.api.deps import Svc
from space.api.errors import APIError
from space.identity import MAX_CSR, MAX_WORKER_ID, WORKER_ID, IdentityError

router = APIRouter(prefix="/v1/workers", tags=["workers"])


class JoinRequest(BaseModel):
    token: str = Field(max_length=200, description="the one-time token made for this worker")
    csr: str = Field(max_length=MAX_CSR, description="a PEM certificate request for its key")


class Joined(BaseModel):
    certificate: str = Field(description="PEM: the worker's serving certificate")
    ca: str = Field(description="PEM: the worker CA, which its callers' certificates come from")


@router.post("/{worker_id}/join", response_model=Joined)
async def join(
    svc: Svc, body: JoinRequest, worker_id: str = Path(pattern=WORKER_ID, max_length=MAX_WORKER_ID)
) -> Joined:
    """403 for a token that is unknown, spent, expired or made for another worker (alike, so
    a guess learns nothing); 404 where workers do not run mutual TLS."""
    ca = svc.worker_ca
    if ca is None:
        raise APIError(404, "this deployment has no worker CA (SPACE_WORKER_CA_DIR)")
    try:
        csr = body.csr.encode()
        ca.issue(worker_id, csr)  # a bad request must not spend the token
    except IdentityError as e:
        raise APIError(400, str(e)) from None
    if not await svc.store.redeem_join_token(worker_id, body.token):
        raise APIError(403, "join token refused")
    return Joined(certificate=ca.issue(worker_id, csr).decode(), ca=ca.ca_pem.decode())

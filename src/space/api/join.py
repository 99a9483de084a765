"""Workers joining the deployment: a one-time join token (`space admin join-token`) traded for
the worker's own certificate from the worker CA, and the worker's registration (it holds no
database credentials). A worker has no API key: the token, and then the worker secret together
with the API's call back to the address it registers, are what let it in."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Path, Response
from pydantic import BaseModel, Field

from space.api.deps import Svc, bearer
from space.api.errors import APIError
from space.db.store import Row
from space.identity import MAX_CSR, MAX_WORKER_ID, WORKER_ID, IdentityError
from space.release import refusal
from space.worker.api.client import Worker, WorkerError
from space.worker.registration import Heartbeat, Registration

router = APIRouter(prefix="/v1/workers", tags=["workers"])
WorkerId = Annotated[str, Path(pattern=WORKER_ID, max_length=MAX_WORKER_ID)]
CALL_BACK_S = 5.0


class JoinRequest(BaseModel):
    token: str = Field(max_length=200, description="the one-time token made for this worker")
    csr: str = Field(max_length=MAX_CSR, description="a PEM certificate request for its key")


class Joined(BaseModel):
    certificate: str = Field(description="PEM: the worker's serving certificate")
    ca: str = Field(description="PEM: the worker CA, which its callers' certificates come from")


@router.post("/{worker_id}/join", response_model=Joined)
async def join(svc: Svc, body: JoinRequest, worker_id: WorkerId) -> Joined:
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


def _worker_secret(svc: Svc, authorization: str | None) -> None:
    if not hmac.compare_digest(bearer(authorization).encode(), svc.worker_secret.encode()):
        raise APIError(401, "a valid worker secret is required (Authorization: Bearer …)")


@router.post("/{worker_id}/register")
async def register(
    svc: Svc, body: Registration, worker_id: WorkerId,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:  # fmt: skip
    """The worker's own call, once it serves. It is recorded as the worker answers at `url`:
    its id and this instance (under mutual TLS, its certificate must name the id), and the
    capacity it admits. 502 if it cannot be reached there, 409 if something else answers."""
    _worker_secret(svc, authorization)
    known = await svc.store.worker(worker_id)
    # No transaction is open across these calls.
    if known is not None and known["url"] != body.url and await _answers(svc, known):
        raise APIError(409, f"worker {worker_id} is alive at {known['url']}: a second process "
                       "of its id is refused until it is gone")  # fmt: skip
    try:
        health = await svc.workers.health(Worker(worker_id, body.url), timeout=CALL_BACK_S)
    except WorkerError as e:
        if e.status == 426:  # it refuses our release: its reason names both
            raise APIError(426, e.detail) from None
        # Its own transport error, never the body of what answered there (whatever that is).
        why = f"it answered HTTP {e.status}" if e.status else str(e)
        raise APIError(502, f"the worker was not reached at {body.url}: {why}"[:1000]) from None
    if health.worker_id != worker_id or health.instance != body.instance:
        raise APIError(409, f"another worker process answers at {body.url}")
    if reason := refusal(health.version, "worker"):
        raise APIError(426, reason)
    await svc.store.register_worker(
        worker_id,
        body.url,
        body.instance,
        health.capacity.vcpus,
        health.capacity.memory_mib,
        health.version,
    )
    return Response(status_code=200)


async def _answers(svc: Svc, known: Row) -> bool:
    """Whether the registered process of a worker still answers where it registered."""
    try:
        health = await svc.workers.health(Worker(known["id"], known["url"]), timeout=CALL_BACK_S)
    except WorkerError:
        return False
    return bool(health.worker_id == known["id"] and health.instance == known["instance"])


@router.post("/{worker_id}/heartbeat", status_code=204)
async def heartbeat(
    svc: Svc, body: Heartbeat, worker_id: WorkerId,
    authorization: Annotated[str | None, Header()] = None,
) -> Response:  # fmt: skip
    """204 while this instance is the one registered under the id; 409 once another is."""
    _worker_secret(svc, authorization)
    row = await svc.store.worker(worker_id)
    if row is None or not hmac.compare_digest(row["instance"], body.instance):
        raise APIError(409, "another process is registered as this worker")
    return Response(status_code=204)

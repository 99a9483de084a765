"""What the worker's errors mean to its callers: a problem+json status for each."""

from __future__ import annotations

from starlette.requests import ClientDisconnect

from space.gateway.client import GatewayError
from space.worker.agent_client import AgentConnectionLost, AgentError
from space.worker.api.bodies import Problem
from space.worker.network import NetworkError
from space.worker.sandboxes import (
    InvalidArgument,
    NoRoom,
    TemplateInUse,
    TemplateNotFound,
    Unavailable,
    VMManagerError,
    VMNotFound,
    VolumeInUse,
    WrongState,
)
from space.worker.vmm.base import VMMError

MANAGER_STATUS: dict[type[VMManagerError], int] = {
    InvalidArgument: 400,
    VMNotFound: 404,
    TemplateNotFound: 404,
    WrongState: 409,
    VolumeInUse: 409,
    TemplateInUse: 409,
    NoRoom: 507,
    Unavailable: 503,
}
AGENT_STATUS = {
    "invalid": 400,
    "is_a_directory": 400,
    "not_a_directory": 400,
    "permission_denied": 403,
    "not_found": 404,
    "exists": 409,
    "busy": 409,
    "not_empty": 409,
    "no_space": 507,
}  # any other code (lost, timeout, internal, unauthenticated): the guest agent failed, 502


def as_problem(e: Exception) -> Problem:
    """What one of our errors means to a caller of the API."""
    if isinstance(e, Problem):
        return e
    if isinstance(e, VolumeInUse):
        return Problem(409, str(e), code="volume_in_use", holders=e.holders)
    if isinstance(e, VMManagerError):
        status = next(s for cls, s in MANAGER_STATUS.items() if isinstance(e, cls))
        return Problem(status, str(e), state=getattr(e, "state", None))
    if isinstance(e, AgentConnectionLost):
        return Problem(502, f"the guest agent failed: {e.message}", code=e.code)
    if isinstance(e, AgentError):
        return Problem(AGENT_STATUS.get(e.code, 502), e.message, code=e.code)
    if isinstance(e, VMMError):
        return Problem(502, f"the VM failed: {e}")
    if isinstance(e, ClientDisconnect):
        return Problem(400, "the client went away before its request body was complete")
    if isinstance(e, GatewayError | NetworkError):
        return Problem(502, f"the sandbox network failed: {e}")
    raise TypeError(f"no problem for {type(e).__name__}")

"""The worker's handle on the gateway: HTTP on a unix socket (root-only; not on any network).

PUT /sandboxes/{id} {"address", "policy"} sets or changes a policy at once (new connections and
queries use it); DELETE /sandboxes/{id}; GET /audit?sandbox=&after=&limit=; GET /ca.pem;
GET /traffic: each sandbox's bytes by host, sent and received, since the gateway took it on
(`epoch` names that run of counts).
"""

from __future__ import annotations

import pydantic
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from space.gateway.policy import SandboxPolicy
from space.gateway.server import Gateway


def _problem(status: int, title: str, detail: str) -> JSONResponse:
    return JSONResponse(
        {"type": "about:blank", "title": title, "status": status, "detail": detail},
        status_code=status,
        media_type="application/problem+json",
    )


def make_app(gateway: Gateway) -> Starlette:
    async def health(request: Request) -> Response:
        return JSONResponse(
            {"ok": True, "sandboxes": len(gateway.sandboxes), "connections": gateway.open,
             "audit": gateway.audit.stats()}
        )  # fmt: skip

    async def put_sandbox(request: Request) -> Response:
        sandbox_id = request.path_params["sandbox_id"]
        try:
            spec = SandboxPolicy.model_validate_json(await request.body())
        except pydantic.ValidationError as e:
            detail = "; ".join(
                f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()
            )
            return _problem(422, "invalid policy", detail)
        gateway.set_policy(sandbox_id, spec)
        return JSONResponse({"sandbox": sandbox_id, "address": spec.address})

    async def get_sandbox(request: Request) -> Response:
        sandbox = gateway.sandboxes.get(request.path_params["sandbox_id"])
        if sandbox is None:
            return _problem(404, "no such sandbox", "the gateway has no policy for it")
        # Secret values never leave the gateway.
        policy = sandbox.policy.model_dump(exclude={"secrets": {"__all__": {"value"}}})
        return JSONResponse(
            {"sandbox": sandbox.id, "address": sandbox.address, "policy": policy,
             "connections": len(sandbox.connections),
             "refused": {"connections": sandbox.refusals.refused,
                         "dns": sandbox.dns_refusals.refused}}
        )  # fmt: skip

    async def delete_sandbox(request: Request) -> Response:
        found = gateway.remove(request.path_params["sandbox_id"])
        return Response(status_code=204 if found else 404)

    async def audit(request: Request) -> Response:
        q = request.query_params
        try:
            after, limit = int(q.get("after", "0")), int(q.get("limit", "1000"))
        except ValueError:
            return _problem(400, "bad query", "after and limit are integers")
        sandbox = q.get("sandbox")
        events = gateway.audit.events(sandbox, after, limit)
        # `dropped`: older events of this sandbox (everyone's, without one) no longer in memory.
        return JSONResponse(
            {"events": [e.to_json() for e in events], "dropped": gateway.audit.dropped(sandbox)}
        )

    async def traffic(request: Request) -> Response:
        return JSONResponse(
            {sid: {"epoch": sandbox.epoch,
                   "hosts": {host: list(counts) for host, counts in sandbox.traffic().items()}}
             for sid, sandbox in gateway.sandboxes.items()}
        )  # fmt: skip

    async def ca(request: Request) -> Response:
        return Response(gateway.ca.pem, media_type="application/x-pem-file")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/sandboxes/{sandbox_id}", put_sandbox, methods=["PUT"]),
            Route("/sandboxes/{sandbox_id}", get_sandbox, methods=["GET"]),
            Route("/sandboxes/{sandbox_id}", delete_sandbox, methods=["DELETE"]),
            Route("/audit", audit),
            Route("/traffic", traffic),
            Route("/ca.pem", ca),
        ]
    )

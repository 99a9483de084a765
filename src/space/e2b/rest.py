"""E2B's control-plane REST API (the calls its SDKs make), answered by SPACE's own sandbox
routes: a create is SPACE's create, a pause is a suspend to disk, a connect resumes.

What the answers carry is what the SDKs parse: camelCase keys, `{"code", "message"}` errors,
201 on create, 204 on kill, timeout and pause, 409 for a pause of a paused sandbox, the
`x-next-token` header for the next page of a list. Every sandbox answer carries an envd
access token (see `tokens`) for the daemon calls that follow.
"""

from __future__ import annotations

import ipaddress
from datetime import timedelta
from typing import Annotated, Any, TypeVar
from urllib.parse import parse_qsl, unquote

from fastapi import APIRouter, Depends, Header, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from space.api import sandboxes as space
from space.api.deps import Svc, authenticate
from space.api.errors import APIError, validation_detail
from space.api.schemas import NetworkUpdate, SandboxCreate, TimeoutUpdate
from space.db.store import Conflict, Row, Tenant
from space.e2b import tokens
from space.netpolicy import NetworkPolicy

router = APIRouter(tags=["e2b"])

# What envd this surface speaks as: the SDKs turn features off below their version gates, and
# every gate of the pinned SDKs is at or below it.
ENVD_VERSION = "0.6.4"
DEFAULT_TIMEOUT_S = 300  # the SDKs' documented default, which they do not send
# E2B's names of templates SPACE has under names of its own: the code interpreter SDK asks
# for its default template by this name.
ALIASES = {"code-interpreter-v1": "code-interpreter"}
# E2B's templates carry their sandboxes' size; SPACE's are sized at create. Each kernel of the
# code interpreter takes ~90 MiB: the default 256 MiB would hold one context and no more.
MEMORY_MIB = {"code-interpreter": 512}
PAUSED = ("paused", "suspended", "pausing", "suspending")
LISTED = ("running", "starting", "claiming", "resuming", *PAUSED)
MAX_PAGE = 100
EVERYWHERE = {"0.0.0.0/0", "::/0"}


async def caller(request: Request, svc: Svc) -> Tenant:
    key = request.headers.get("x-api-key", "").strip()
    if not key:
        raise APIError(401, "missing API key: send 'X-API-Key: <key>' (E2B_API_KEY)")
    return await authenticate(svc, key)


E2BCaller = Annotated[Tenant, Depends(caller)]


class Lenient(BaseModel):
    """A body as E2B's SDKs send it: camelCase, and fields of newer SDKs ignored."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class NetworkConfig(Lenient):
    allow_out: list[str] | None = Field(None, alias="allowOut", max_length=256)
    deny_out: list[str] | None = Field(None, alias="denyOut", max_length=256)


class NetworkChange(NetworkConfig):
    """E2B's update of a sandbox's egress: the whole of it, what is left out is cleared."""

    allow_internet_access: bool | None = None
    # E2B's that SPACE's gateway does its own way: refused on an update, so that nothing the
    # caller asked for is silently left out of what is in force.
    dns_servers: list[str] | None = Field(None, alias="dnsServers")
    egress_proxy: dict[str, Any] | None = Field(None, alias="egressProxy")
    rules: dict[str, Any] | None = None


class NewSandbox(Lenient):
    template_id: str = Field("base", alias="templateID", min_length=1, max_length=64)
    timeout: int | None = Field(None, ge=1, le=7 * 24 * 3600)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    auto_pause: bool = Field(False, alias="autoPause")
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    mcp: dict[str, Any] | None = None
    volume_mounts: list[dict[str, Any]] | None = Field(None, alias="volumeMounts")


class Timeout(Lenient):
    timeout: int = Field(ge=1, le=7 * 24 * 3600)


class Connect(Lenient):
    timeout: int | None = Field(None, ge=1, le=7 * 24 * 3600)


def e2b_state(row: Row) -> str:
    return "paused" if row["state"] in PAUSED else "running"


def egress(network: NetworkConfig | None, internet: bool | None) -> NetworkPolicy | None:
    """E2B's egress switches as a SPACE policy. Without one SPACE's default holds (deny, unless
    the operator chose otherwise), where E2B's is to let everything out: an E2B user who wants
    the internet says so. One who says no gets no, whatever the default."""
    out = network.allow_out if network else None
    denied = set(network.deny_out or ()) if network else set()
    if denied - EVERYWHERE:
        raise APIError(400, "network.denyOut takes only 0.0.0.0/0 (SPACE denies what "
                            "network.allowOut does not list)")  # fmt: skip
    if out and "0.0.0.0/0" in out:  # E2B's "all traffic"
        return NetworkPolicy(default="allow")
    if out:
        hosts: list[str] = []
        cidrs: list[str] = []
        for entry in out:
            (cidrs if _is_network(entry) else hosts).append(entry)
        return _valid(NetworkPolicy, {
            "hosts": [{"pattern": h} for h in hosts], "cidrs": [{"cidr": c} for c in cidrs],
        })  # fmt: skip
    if internet:
        return NetworkPolicy(default="allow")
    if internet is False or denied:
        return NetworkPolicy(default="deny")
    return None


def _is_network(entry: str) -> bool:
    try:
        ipaddress.ip_network(entry, strict=False)
    except ValueError:
        return False
    return True


M = TypeVar("M", bound=BaseModel)


def _valid(model: type[M], values: dict[str, Any]) -> M:
    """SPACE's own model of what the E2B body said; what it refuses is the caller's 400."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        detail = validation_detail(e.errors())
        raise APIError(400, detail) from None


def sandbox(row: Row, svc: Svc, who: Tenant) -> dict[str, Any]:
    """The answer to a create or a connect: who it is, and how to reach its daemon."""
    return {
        "templateID": row["template"],
        "sandboxID": row["id"],
        "alias": row["template"],
        "clientID": row["worker_id"] or "space",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": tokens.issue(svc, who, row["id"]),
        "trafficAccessToken": tokens.issue(svc, who, row["id"], tokens.TRAFFIC),
        "domain": svc.settings.api.preview_domain,
    }


def listed(row: Row) -> dict[str, Any]:
    created = row["created_at"]
    end = row["expires_at"] or created + timedelta(seconds=row["timeout_s"])
    return {
        "templateID": row["template"],
        "sandboxID": row["id"],
        "alias": row["template"],
        "clientID": row["worker_id"] or "space",
        "startedAt": created.isoformat(),
        "endAt": end.isoformat(),
        "cpuCount": row["vcpus"],
        "memoryMB": row["memory_mib"],
        "diskSizeMB": row["disk_mib"],
        "state": e2b_state(row),
        "envdVersion": ENVD_VERSION,
        "metadata": row["metadata"] or {},
    }


async def alive(svc: Svc, who: Tenant, sandbox_id: str) -> Row:
    """One of the caller's sandboxes that has not ended (404 for anyone else's, or a gone one:
    E2B knows no deleted sandboxes)."""
    row = await svc.store.get_sandbox(sandbox_id, who.id)
    if row["state"] not in LISTED:
        raise APIError(404, f"sandbox {sandbox_id} not found")
    return row


@router.post("/v2/sandboxes", status_code=201)
@router.post("/sandboxes", status_code=201, include_in_schema=False)
async def create(
    body: NewSandbox,
    svc: Svc,
    who: E2BCaller,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> dict[str, Any]:
    if body.mcp is not None or body.volume_mounts:
        raise APIError(400, "mcp and volumeMounts are not supported by SPACE's E2B surface")
    template = ALIASES.get(body.template_id, body.template_id)
    # The caller's own snapshot of that name first (see `snapshots`), as E2B's names are a team's.
    if await svc.store.usable_template(own := space.chosen_id(template, who.id), who.id):
        template = own
    shape = {"memory_mib": MEMORY_MIB[template]} if template in MEMORY_MIB else {}
    spec = _valid(SandboxCreate, {
        **shape,
        "template": template,
        "timeout_s": body.timeout or DEFAULT_TIMEOUT_S,
        "timeout_action": "suspend" if body.auto_pause else "delete",
        "env": body.env_vars or {},
        "metadata": body.metadata or {},
        "network": egress(body.network, body.allow_internet_access),
    })  # fmt: skip
    made = await space.create_sandbox(spec, svc, who, Response(), idempotency_key)
    return sandbox(await svc.store.get_sandbox(made.id, who.id), svc, who)


@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/connect", include_in_schema=False)
@router.post("/sandboxes/{sandbox_id}/resume", status_code=201, include_in_schema=False)
async def connect(
    sandbox_id: str, body: Connect, svc: Svc, who: E2BCaller, response: Response
) -> dict[str, Any]:
    """Connect to a running sandbox (200), or resume a paused one first (201)."""
    row = await alive(svc, who, sandbox_id)
    if row["state"] in PAUSED:
        await space.resume_sandbox(sandbox_id, svc, who)
        response.status_code = 201
    if body.timeout is not None:
        await svc.store.set_timeout(who.id, sandbox_id, body.timeout)
    return sandbox(await alive(svc, who, sandbox_id), svc, who)


@router.get("/v2/sandboxes")
@router.get("/sandboxes", include_in_schema=False)
async def list_sandboxes(
    svc: Svc,
    who: E2BCaller,
    response: Response,
    state: Annotated[str | None, Query(max_length=64)] = None,
    metadata: Annotated[str | None, Query(max_length=8192)] = None,
    template: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = MAX_PAGE,
    next_token: Annotated[str | None, Query(alias="nextToken", max_length=512)] = None,
) -> list[dict[str, Any]]:
    wanted = {s.strip() for s in state.split(",")} if state else {"running", "paused"}
    if not wanted <= {"running", "paused"}:
        raise APIError(400, f"state is a list of running and paused, not {state!r}")
    states = [s for s in LISTED if (s in PAUSED and "paused" in wanted)
              or (s not in PAUSED and "running" in wanted)]  # fmt: skip
    rows = await svc.store.list_sandboxes(
        who.id, states=states, template=template, metadata=_metadata(metadata) or None,
        limit=limit + 1, after=space.parse_cursor(next_token) if next_token else None,
    )  # fmt: skip
    if len(rows) > limit:
        rows = rows[:limit]
        response.headers["x-next-token"] = space.page_cursor(rows[-1])
    return [listed(r) for r in rows]


def _metadata(query: str | None) -> dict[str, str]:
    """The SDKs send metadata as one query value, itself a query string of escaped pairs."""
    if not query:
        return {}
    pairs = {unquote(k): unquote(v) for k, v in parse_qsl(query, keep_blank_values=True)}
    if any("\0" in k or "\0" in v for k, v in pairs.items()):
        raise APIError(400, "metadata filters may not contain NUL bytes")
    return pairs


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, svc: Svc, who: E2BCaller) -> dict[str, Any]:
    row = await alive(svc, who, sandbox_id)
    return {**listed(row), "domain": svc.settings.api.preview_domain}


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill(sandbox_id: str, svc: Svc, who: E2BCaller) -> Response:
    """Whatever state it is in (one that failed or is still starting too), until deleted."""
    if (await svc.store.get_sandbox(sandbox_id, who.id))["state"] == "deleted":
        raise APIError(404, f"sandbox {sandbox_id} not found")
    await space.delete_sandbox(sandbox_id, svc, who)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: Timeout, svc: Svc, who: E2BCaller) -> Response:
    await alive(svc, who, sandbox_id)
    await space.set_timeout(sandbox_id, TimeoutUpdate(timeout_s=body.timeout), svc, who)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(sandbox_id: str, svc: Svc, who: E2BCaller) -> Response:
    """E2B's pause keeps the whole machine for later: SPACE's suspend, to disk."""
    row = await alive(svc, who, sandbox_id)
    if row["state"] in PAUSED:
        raise APIError(409, f"sandbox {sandbox_id} is already paused")
    try:
        await space.suspend_sandbox(sandbox_id, svc, who)
    except Conflict as e:
        raise APIError(409, str(e)) from None
    return Response(status_code=204)


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(
    sandbox_id: str, body: NetworkChange, svc: Svc, who: E2BCaller
) -> Response:
    """The sandbox's egress policy replaced, in force when answered with 204 (SPACE's own
    update): without `allowOut` or `allow_internet_access`, SPACE's default policy."""
    await alive(svc, who, sandbox_id)
    if body.dns_servers or body.egress_proxy or body.rules:
        raise APIError(400, "dnsServers, egressProxy and rules are not supported by SPACE's E2B "
                            "surface: SPACE's gateway resolves names and injects credentials "
                            "itself (its own API: secrets bound to hosts)")  # fmt: skip
    policy = egress(body, body.allow_internet_access)
    if policy is None:
        policy = NetworkPolicy(default=svc.settings.egress_default)
    answer = Response(status_code=204)
    await space.set_network(sandbox_id, NetworkUpdate(network=policy), svc, who, answer)
    # 202 when its worker had not put it in force within seconds (it will once it answers).
    return Response(status_code=answer.status_code)

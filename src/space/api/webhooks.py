"""Webhook routes: a tenant's endpoints for its sandboxes' lifecycle events (space.webhooks),
and every delivery with its attempts. The signing secret is shown once, when it is made."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.schemas import (
    CreatedWebhook,
    NewWebhook,
    WebhookDelivery,
    WebhookDeliveryList,
    WebhookInfo,
    WebhookList,
)
from space.db.store import NotFound
from space.webhooks.targets import TargetRefused, check_url, egress_floor

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


@router.post("", response_model=CreatedWebhook, status_code=201)
async def create_webhook(
    body: NewWebhook, svc: Svc, caller: Caller, response: Response
) -> CreatedWebhook:
    """422 for a URL no webhook may have (not http(s), or an address the floor never lets
    anything dial: loopback, link-local, private ranges the operator did not open to webhooks)."""
    try:
        url = check_url(body.url, egress_floor(list(svc.settings.webhook_open_networks)))
    except TargetRefused as e:
        raise APIError(422, f"webhook URL refused: {e}") from None
    made, secret = await svc.store.create_webhook(
        caller.id, url, list(body.events), body.description, svc.sealer
    )
    response.headers["Cache-Control"] = "no-store"
    return CreatedWebhook.model_validate({**made.__dict__, "secret": secret})


@router.get("", response_model=WebhookList)
async def list_webhooks(svc: Svc, caller: Caller) -> WebhookList:
    return WebhookList(
        items=[WebhookInfo.model_validate(w) for w in await svc.store.webhooks(caller.id)]
    )


@router.get("/{webhook_id}", response_model=WebhookInfo)
async def get_webhook(webhook_id: str, svc: Svc, caller: Caller) -> WebhookInfo:
    found = await svc.store.webhooks(caller.id, webhook_id)
    if not found:
        raise APIError(404, f"no webhook {webhook_id!r}")
    return WebhookInfo.model_validate(found[0])


@router.delete("/{webhook_id}", status_code=204)
async def delete_webhook(webhook_id: str, svc: Svc, caller: Caller) -> Response:
    """Nothing more is sent to it, and what it was owed goes with it."""
    try:
        await svc.store.delete_webhook(caller.id, webhook_id)
    except NotFound:
        raise APIError(404, f"no webhook {webhook_id!r}") from None
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=WebhookDeliveryList)
async def list_deliveries(
    webhook_id: str, svc: Svc, caller: Caller, limit: Annotated[int, Query(ge=1, le=500)] = 100
) -> WebhookDeliveryList:
    """Newest first, each with its attempts (oldest first): status, error, time taken."""
    try:
        found = await svc.store.deliveries(caller.id, webhook_id, limit)
    except NotFound:
        raise APIError(404, f"no webhook {webhook_id!r}") from None
    return WebhookDeliveryList(items=[WebhookDelivery.model_validate(d) for d in found])

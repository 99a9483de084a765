"""Template routes: what every tenant may start from, and each template's warm pool."""

from __future__ import annotations

from fastapi import APIRouter

from space.api.deps import Caller, Svc
from space.api.errors import APIError
from space.api.schemas import PoolSettings, Template, TemplateList
from space.db.store import NotFound

router = APIRouter(prefix="/v1/templates", tags=["templates"])


@router.get("", response_model=TemplateList)
async def list_templates(svc: Svc, caller: Caller) -> TemplateList:
    return TemplateList(items=[Template.from_row(r) for r in await svc.store.templates()])


@router.get("/{template_id}", response_model=Template)
async def get_template(template_id: str, svc: Svc, caller: Caller) -> Template:
    rows = await svc.store.templates(template_id)
    if not rows:
        raise APIError(404, f"no template {template_id!r}")
    return Template.from_row(rows[0])


@router.put("/{template_id}/pool", response_model=Template)
async def set_pool(template_id: str, body: PoolSettings, svc: Svc, caller: Caller) -> Template:
    """Size and shape of the template's warm pool (admin keys only). The controller fills or
    shrinks it in the background; members of another shape are let go."""
    if not caller.admin:
        raise APIError(403, "only an admin key may change a warm pool")
    try:
        await svc.store.set_pool(template_id, body.size, body.vcpus, body.memory_mib,
                                 body.disk_mib)  # fmt: skip
    except NotFound:
        raise APIError(404, f"no template {template_id!r}") from None
    return await get_template(template_id, svc, caller)

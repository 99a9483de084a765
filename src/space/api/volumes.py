"""Volume routes: disks of a tenant's own that outlive its sandboxes."""

from __future__ import annotations

from fastapi import APIRouter

from space.api.deps import Caller, Svc
from space.api.schemas import Volume, VolumeCreate, VolumeList

router = APIRouter(prefix="/v1/volumes", tags=["volumes"])


@router.post("", status_code=201, response_model=Volume)
async def create_volume(body: VolumeCreate, svc: Svc, caller: Caller) -> Volume:
    """An empty ext4 volume; its image is made on the worker of the first sandbox using it."""
    row = await svc.store.create_volume(caller.id, body.name, body.size_mib, svc.settings.quotas)
    return Volume.from_row(row)


@router.get("", response_model=VolumeList)
async def list_volumes(svc: Svc, caller: Caller) -> VolumeList:
    return VolumeList(items=[Volume.from_row(r) for r in await svc.store.volumes(caller.id)])


@router.get("/{volume_id}", response_model=Volume)
async def get_volume(volume_id: str, svc: Svc, caller: Caller) -> Volume:
    return Volume.from_row(await svc.store.volume(volume_id, caller.id))


@router.delete("/{volume_id}", response_model=Volume)
async def delete_volume(volume_id: str, svc: Svc, caller: Caller) -> Volume:
    """Refused (409) while a sandbox that is not deleted has it; its data is then gone."""
    return Volume.from_row(await svc.store.delete_volume(caller.id, volume_id))

"""What one tenant may hold at once: sandboxes and their vCPUs, memory and disk, volumes and
their size, checkpoints and their bytes. Defaults come from the deployment's settings; an
operator overrides them per tenant (`space admin quota`). Checked in the same transaction that
adds a sandbox, a volume or a checkpoint, with the tenant's row locked, so two concurrent
creates cannot both take the last unit."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

UNITS = {
    "sandboxes": "sandboxes",
    "vcpus": "vCPUs",
    "memory_mib": "MiB of memory",
    "disk_mib": "MiB of sandbox disk",
    "volumes": "volumes",
    "volume_mib": "MiB of volumes",
    "checkpoints": "checkpoints",
    "checkpoint_mib": "MiB of checkpoints",
}


@dataclass(frozen=True)
class Quotas:
    sandboxes: int = 50  # not deleted: running, paused, suspended, pending or in error
    vcpus: int = 64
    memory_mib: int = 64 << 10
    disk_mib: int = 512 << 10  # sparse disks still count at their full size
    volumes: int = 50
    volume_mib: int = 1 << 20
    checkpoints: int = 100
    # On the worker's pool; one being taken counts as its sandbox's memory until its size is known.
    checkpoint_mib: int = 256 << 10

    def with_overrides(self, overrides: dict[str, Any]) -> Quotas:
        known = {f.name for f in fields(self)}
        return replace(self, **{k: int(v) for k, v in overrides.items() if k in known})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def over(quotas: Quotas, total: dict[str, int]) -> str | None:
    """What `total` (what the tenant holds, the new sandbox or volume included) puts past
    `quotas`, or None."""
    limits = quotas.as_dict()
    past = [f"{total[k]} {UNITS[k]} > {limits[k]}" for k in total if total[k] > limits[k]]
    return "quota exceeded: " + "; ".join(past) if past else None


def validate_overrides(overrides: dict[str, Any]) -> dict[str, int]:
    """An operator's overrides, checked: known names, whole numbers ≥ 0 (ValueError if not)."""
    out = {}
    for k, v in overrides.items():
        if k not in UNITS:
            raise ValueError(f"no quota {k!r}: one of {', '.join(UNITS)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"quota {k} must be a whole number ≥ 0, not {v!r}")
        out[k] = v
    return out

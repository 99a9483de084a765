"""Formats of what a worker writes to disk, or to the registry, that a later worker reads.

Each record carries `format`, the version of its layout. A reader takes its own format and any
older one (a record without `format` is of format 1, from before formats were written); a newer
one is refused with the reason, never misread: a worker rolled back past a release that changed
a format leaves such records alone.
"""

from __future__ import annotations

from typing import Any

from space.release import VERSION

FIELD = "format"
# What this release writes, and the newest it reads, per kind of record.
FORMATS = {
    "sandbox": 1,  # a VM's record: sandboxes/records.py
    "vm": 1,  # a VMM's own record, for adoption: vmm/qemu.py
    "snapshot": 1,  # a snapshot's manifest (suspended, checkpoints, base snapshots): vmm/base.py
    "bundle": 1,  # a template, snapshot or volume pushed to the registry: artifacts/bundle.py
}


class FormatError(ValueError):
    """A record of a format this release does not read."""


def stamp(kind: str, record: dict[str, Any]) -> dict[str, Any]:
    """`record` with this release's format of `kind`."""
    return {**record, FIELD: FORMATS[kind]}


def check(kind: str, record: Any, where: object) -> None:
    """Refuse a `kind` record (found at `where`) this release cannot read."""
    if not isinstance(record, dict):
        raise FormatError(f"{where}: not a {kind} record")
    found = record.get(FIELD, 1)
    if not isinstance(found, int) or isinstance(found, bool) or found < 1:
        raise FormatError(f"{where}: {FIELD} {found!r} is not a format")
    if found > FORMATS[kind]:
        raise FormatError(
            f"{where}: a {kind} record of format {found}, newer than release {VERSION} reads "
            f"({FORMATS[kind]}): a later release wrote it; run that release to use it"
        )

"""What an event row means to a webhook: the event types a tenant subscribes to, and the JSON
body each delivery carries. Rows are a sandbox's, or the end of a template's build (its tenant:
whose key asked for it)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from space.db.store.templates import BUILD_EVENT, build_subject

TIMED_OUT: Final = "its timeout passed"  # the reason the controller records (controller.upkeep)
IDLE: Final = "idle for "  # how the idle policy's reason starts (controller.health)

EVENT_TYPES: Final = (
    "sandbox.created",
    "sandbox.running",
    "sandbox.paused",
    "sandbox.idle_paused",
    "sandbox.suspended",
    "sandbox.resumed",
    "sandbox.timed_out",
    "sandbox.failed",
    "sandbox.deleted",
    "template.build_finished",
)

_REACHED = {"paused": "sandbox.paused", "suspended": "sandbox.suspended",
            "error": "sandbox.failed", "deleted": "sandbox.deleted"}  # fmt: skip


def event_types(kind: str, from_state: str | None, to_state: str | None,
                reason: str | None) -> list[str]:  # fmt: skip
    """The webhook events an `events` row stands for (none for a step on the way).

    Why a change was asked for comes first (`sandbox.timed_out`, `sandbox.idle_paused`), what
    the sandbox reached follows as its own event once it has (`sandbox.paused`, ...)."""
    if kind == BUILD_EVENT:
        return ["template.build_finished"]
    if kind == "created":
        return ["sandbox.created", "sandbox.running"] if to_state == "running" else [
            "sandbox.created"]  # fmt: skip
    if kind == "requested":
        if reason == TIMED_OUT:
            return ["sandbox.timed_out"]
        if to_state == "paused" and (reason or "").startswith(IDLE):
            return ["sandbox.idle_paused"]
        return []
    if kind != "state" or to_state is None:
        return []
    if to_state == "running":
        return ["sandbox.resumed" if from_state == "resuming" else "sandbox.running"]
    return [_REACHED[to_state]] if to_state in _REACHED else []


def payload(event_type: str, row: Mapping[Any, Any]) -> dict[str, Any]:
    """A delivery's body: the event, its sandbox (or template), the states it went between,
    and why."""
    at: datetime = row["at"]
    if row["type"] == BUILD_EVENT:
        return {
            "id": f"{row['id']}.{event_type}",
            "type": event_type,
            "at": at.isoformat(),
            "tenant_id": row["tenant_id"],
            "template": row["sandbox_id"].removeprefix(build_subject("")),
            "state": row["to_state"],  # ready | failed
            "error": row["reason"],
        }
    return {
        "id": f"{row['id']}.{event_type}",
        "type": event_type,
        "at": at.isoformat(),
        "tenant_id": row["tenant_id"],
        "sandbox_id": row["sandbox_id"],
        "from_state": row["from_state"],
        "to_state": row["to_state"],
        "reason": row["reason"],
    }

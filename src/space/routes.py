"""The route an HTTP call took, as its application's router matched it: what the audit log
records and what a trace names its span."""

from __future__ import annotations

from starlette.types import Scope


def route_of(scope: Scope) -> str | None:
    """The matched route's path, under the prefix of the application it was mounted at (the
    E2B surface's `/e2b`); None if no route matched (yet)."""
    route = scope.get("route")
    if route is None or not isinstance(getattr(route, "path", None), str):
        return None
    base, root = scope.get("app_root_path", ""), scope.get("root_path", "")
    prefix = root[len(base) :] if root.startswith(base) else ""
    return f"{prefix}{route.path}"

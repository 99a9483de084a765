"""The SPACE Python SDK: sandboxes over the HTTP API, synchronous (`Space`, `Sandbox`) and
asynchronous (`AsyncSpace`, `AsyncSandbox`). Users import these from `space`.

Each name is loaded from its module on first use, so importing one part (the CLI's reading of
the credentials file, say) does not import the HTTP stack.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

# httpx imports its own command-line client (rich, pygments, click: ~40 ms) whenever those are
# installed; nothing here runs it. A None entry makes that one import fail, and httpx then
# defines a stand-in for its `main`; everything else in httpx is untouched.
if "httpx" not in sys.modules:
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]

if TYPE_CHECKING:
    from space.client._async import (
        AsyncExecStream,
        AsyncFiles,
        AsyncProcesses,
        AsyncSandbox,
        AsyncSpace,
    )
    from space.client._calls import (
        AuditFilters,
        CreateOptions,
        ExecOptions,
        ListFilters,
        RequestOptions,
        UsageFilters,
    )
    from space.client._errors import (
        APIError,
        AuthenticationError,
        ConflictError,
        ConnectionError,
        ExecError,
        NotFoundError,
        SpaceError,
        ValidationError,
    )
    from space.client._models import (
        AuditEvent,
        AuditRecord,
        CheckpointInfo,
        Event,
        ExecResult,
        FileEntry,
        FileEvent,
        HostUsage,
        PoolInfo,
        PreviewLink,
        ProcessInfo,
        SandboxInfo,
        SecretInfo,
        TemplateInfo,
        Usage,
        UsageSeries,
        VolumeInfo,
    )
    from space.client._pty import AsyncPty, AsyncTerminal, Pty, Terminal
    from space.client._sync import ExecStream, Files, Processes, Sandbox, Space
    from space.client._watch import AsyncFileWatch, FileWatch
    from space.client._webhooks import WebhookSignatureError, verify_webhook

__all__ = [
    "APIError",
    "AsyncExecStream",
    "AsyncFileWatch",
    "AsyncFiles",
    "AsyncProcesses",
    "AsyncPty",
    "AsyncSandbox",
    "AsyncSpace",
    "AsyncTerminal",
    "AuditEvent",
    "AuditFilters",
    "AuditRecord",
    "AuthenticationError",
    "CheckpointInfo",
    "ConflictError",
    "ConnectionError",
    "CreateOptions",
    "Event",
    "ExecError",
    "ExecOptions",
    "ExecResult",
    "ExecStream",
    "FileEntry",
    "FileEvent",
    "FileWatch",
    "Files",
    "HostUsage",
    "ListFilters",
    "NotFoundError",
    "PoolInfo",
    "PreviewLink",
    "ProcessInfo",
    "Processes",
    "Pty",
    "RequestOptions",
    "Sandbox",
    "SandboxInfo",
    "SecretInfo",
    "Space",
    "SpaceError",
    "TemplateInfo",
    "Terminal",
    "Usage",
    "UsageFilters",
    "UsageSeries",
    "ValidationError",
    "VolumeInfo",
    "WebhookSignatureError",
    "verify_webhook",
]

# Searched in this order, lightest first: errors and models need no HTTP stack.
_MODULES = ("_errors", "_models", "_webhooks", "_calls", "_watch", "_pty", "_sync", "_async")


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module in _MODULES:
            home = importlib.import_module(f"space.client.{module}")
            if name in vars(home):
                value = vars(home)[name]
                globals()[name] = value  # later lookups skip this function
                return value
    raise AttributeError(f"module 'space.client' has no attribute {name!r}")

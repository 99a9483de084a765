"""SPACE: a self-hostable Sandboxed Platform for Agentic Code Execution."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from space.release import VERSION as __version__

# The SDK is loaded on first use of one of its names: `import space` alone stays cheap for the
# CLI and for host modules that never talk HTTP (importing httpx costs ~0.1 s).
if TYPE_CHECKING:
    from space.client import (
        APIError,
        AsyncExecStream,
        AsyncFiles,
        AsyncFileWatch,
        AsyncProcesses,
        AsyncPty,
        AsyncSandbox,
        AsyncSpace,
        AsyncTerminal,
        AuditEvent,
        AuthenticationError,
        CheckpointInfo,
        ConflictError,
        ConnectionError,
        CreateOptions,
        Event,
        ExecError,
        ExecOptions,
        ExecResult,
        ExecStream,
        FileEntry,
        FileEvent,
        Files,
        FileWatch,
        ListFilters,
        NotFoundError,
        PoolInfo,
        PreviewLink,
        Processes,
        ProcessInfo,
        Pty,
        Sandbox,
        SandboxInfo,
        SecretInfo,
        Space,
        SpaceError,
        TemplateInfo,
        Terminal,
        ValidationError,
        VolumeInfo,
        WebhookSignatureError,
        verify_webhook,
    )

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
    "ListFilters",
    "NotFoundError",
    "PoolInfo",
    "PreviewLink",
    "ProcessInfo",
    "Processes",
    "Pty",
    "Sandbox",
    "SandboxInfo",
    "SecretInfo",
    "Space",
    "SpaceError",
    "TemplateInfo",
    "Terminal",
    "ValidationError",
    "VolumeInfo",
    "WebhookSignatureError",
    "__version__",
    "verify_webhook",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import space.client

        value = getattr(space.client, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'space' has no attribute {name!r}")

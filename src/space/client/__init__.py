"""The SPACE Python SDK: sandboxes over the HTTP API, synchronous (`Space`, `Sandbox`) and
asynchronous (`AsyncSpace`, `AsyncSandbox`). Users import these from `space`."""

from space.client._async import AsyncExecStream, AsyncFiles, AsyncSandbox, AsyncSpace
from space.client._calls import CreateOptions, ExecOptions, ListFilters
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
    Event,
    ExecResult,
    FileEntry,
    PoolInfo,
    SandboxInfo,
    TemplateInfo,
    VolumeInfo,
)
from space.client._sync import ExecStream, Files, Sandbox, Space

__all__ = [
    "APIError",
    "AsyncExecStream",
    "AsyncFiles",
    "AsyncSandbox",
    "AsyncSpace",
    "AuthenticationError",
    "ConflictError",
    "ConnectionError",
    "CreateOptions",
    "Event",
    "ExecError",
    "ExecOptions",
    "ExecResult",
    "ExecStream",
    "FileEntry",
    "Files",
    "ListFilters",
    "NotFoundError",
    "PoolInfo",
    "Sandbox",
    "SandboxInfo",
    "Space",
    "SpaceError",
    "TemplateInfo",
    "ValidationError",
    "VolumeInfo",
]

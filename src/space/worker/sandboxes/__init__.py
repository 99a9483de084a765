"""A worker's sandboxes: their VMs, disks, snapshots, volumes and recovery (see `manager`)."""

from space.worker.sandboxes.errors import (
    InvalidArgument,
    NoRoom,
    TemplateInUse,
    TemplateNotFound,
    Unavailable,
    VMManagerError,
    VMNotFound,
    VolumeInUse,
    WrongState,
)
from space.worker.sandboxes.manager import ManagerOptions, VMManager
from space.worker.sandboxes.records import SandboxVM, VolumeMount

__all__ = [
    "InvalidArgument",
    "ManagerOptions",
    "NoRoom",
    "SandboxVM",
    "TemplateInUse",
    "TemplateNotFound",
    "Unavailable",
    "VMManager",
    "VMManagerError",
    "VMNotFound",
    "VolumeInUse",
    "VolumeMount",
    "WrongState",
]

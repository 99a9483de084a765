"""What the worker's sandbox manager refuses, as exceptions the worker API maps to statuses."""

from __future__ import annotations


class VMManagerError(Exception):
    """A request the manager refused; the message says what was wrong."""


class InvalidArgument(VMManagerError):
    pass


class VMNotFound(VMManagerError):
    pass


class TemplateNotFound(VMManagerError):
    pass


class WrongState(VMManagerError):
    """The VM is not in a state that allows the operation; `state` is the one it is in."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


class NoRoom(VMManagerError):
    """The worker's vCPU, memory or disk capacity would be exceeded."""


class VolumeInUse(VMManagerError):
    """A volume some VM on this worker still has attached (one writer, or only readers)."""

    def __init__(self, message: str, holders: list[str] | None = None) -> None:
        super().__init__(message)
        self.holders = holders or []  # the VMs that hold it here


class TemplateInUse(VMManagerError):
    """A template some sandbox on this worker was made from."""


class Unavailable(VMManagerError):
    """The worker cannot do this now (its gateway is down, a VMM does not answer); retry."""

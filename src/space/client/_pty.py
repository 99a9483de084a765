"""Terminals (`sandbox.pty`): a background process on a PTY that a program drives.

A terminal is a background process started with a PTY and its stdin kept open, so it outlives
the calls that drive it: keystrokes go in by `write`, the screen's bytes come out of `output`
(stdout only: a PTY merges both streams), and anyone can `connect` to it again by its pid or
tag. `space shell` is the interactive twin, attached to the local terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, Unpack

from space.client._calls import ExecOptions, ProcessRef
from space.client._models import ExecResult, ProcessInfo

if TYPE_CHECKING:
    from space.client._async import AsyncExecStream, AsyncProcesses
    from space.client._exec import OutputCallback
    from space.client._sync import ExecStream, Processes

# The user's login shell where the template has bash, else whatever /bin/sh is.
DEFAULT_SHELL = 'exec "$(command -v bash || echo /bin/sh)" -l'
DEFAULT_TERM = "xterm-256color"

P = TypeVar("P")


def pty_options(options: ExecOptions) -> ExecOptions:
    """A terminal's start: a PTY (24 x 80 unless `rows`, `cols`), stdin kept open, TERM set
    unless the caller set it."""
    env = {"TERM": DEFAULT_TERM, **(options.get("env") or {})}
    return {**options, "env": env, "pty": True, "keep_stdin": True, "background": True}


class TerminalBase(Generic[P]):
    """The I/O-free part of `Terminal` and `AsyncTerminal`; `info` is the process as it was
    when this handle was made."""

    def __init__(self, processes: P, info: ProcessInfo) -> None:
        self._processes = processes
        self.info = info

    @property
    def pid(self) -> int:
        return self.info.pid


class Terminal(TerminalBase["Processes"]):
    """One terminal in a sandbox."""

    def write(self, data: bytes | str) -> None:
        """Keystrokes: `"ls\\n"`, or `"\\x03"` for Ctrl-C."""
        self._processes.send_stdin(self.pid, data)

    def resize(self, rows: int, cols: int) -> None:
        self._processes.resize(self.pid, rows, cols)

    def output(self, *, replay: bool = True) -> ExecStream:
        """The screen's bytes: what was kept first (unless `replay` is False), then as they
        come, then `result` once the terminal's program exits. Closing it leaves it running."""
        return self._processes.connect(self.pid, replay=replay)

    def wait(self, on_data: OutputCallback | None = None) -> ExecResult:
        """Until its program exits (send `exit\\n`, or `kill`)."""
        return self._processes.wait(self.pid, on_stdout=on_data)

    def refresh(self) -> ProcessInfo:
        self.info = self._processes.get(self.pid)
        return self.info

    def kill(self) -> None:
        self._processes.kill(self.pid)


class Pty:
    """The terminals of one sandbox (`sandbox.pty`)."""

    def __init__(self, processes: Processes) -> None:
        self._processes = processes

    def create(
        self,
        command: str | Sequence[str] | None = None,
        **options: Unpack[ExecOptions],
    ) -> Terminal:
        """A terminal running `command` (default: a login shell); `tag` names it."""
        command = command if command is not None else DEFAULT_SHELL
        info = self._processes.start(command, **pty_options(options))
        return Terminal(self._processes, info)

    def connect(self, ref: ProcessRef) -> Terminal:
        """A terminal that is already there, by pid or tag."""
        return Terminal(self._processes, self._processes.get(ref))


class AsyncTerminal(TerminalBase["AsyncProcesses"]):
    """One terminal in a sandbox; see `space.Terminal`."""

    async def write(self, data: bytes | str) -> None:
        await self._processes.send_stdin(self.pid, data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._processes.resize(self.pid, rows, cols)

    def output(self, *, replay: bool = True) -> AsyncExecStream:
        return self._processes.connect(self.pid, replay=replay)

    async def wait(self, on_data: OutputCallback | None = None) -> ExecResult:
        return await self._processes.wait(self.pid, on_stdout=on_data)

    async def refresh(self) -> ProcessInfo:
        self.info = await self._processes.get(self.pid)
        return self.info

    async def kill(self) -> None:
        await self._processes.kill(self.pid)


class AsyncPty:
    """The terminals of one sandbox (`sandbox.pty`); see `space.Pty`."""

    def __init__(self, processes: AsyncProcesses) -> None:
        self._processes = processes

    async def create(
        self,
        command: str | Sequence[str] | None = None,
        **options: Unpack[ExecOptions],
    ) -> AsyncTerminal:
        command = command if command is not None else DEFAULT_SHELL
        info = await self._processes.start(command, **pty_options(options))
        return AsyncTerminal(self._processes, info)

    async def connect(self, ref: ProcessRef) -> AsyncTerminal:
        return AsyncTerminal(self._processes, await self._processes.get(ref))

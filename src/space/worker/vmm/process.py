"""A VMM process, launched by us or adopted after a restart, watched through a pidfd.

Every VMM runs in a session of its own (TCG guests were seen to stall in early boot when run in
the caller's session) and outlives the process that launched it, so that a worker restart does
not take its VMs down: a restarted worker adopts them by pid.

VMMs run niced (every thread of theirs, from exec on): a host whose guests burn every core still
answers its controller's probes, its API and its gateway's traffic, rather than sharing the CPU
evenly with each of a hundred vCPU threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from space.worker.vmm.base import VMGone, VMMError

if TYPE_CHECKING:
    from space.worker.vmm.jail import Confinement

HIGH_FD = 1000  # where descriptors for a child are parked while its own are laid out
VMM_NICE = 10  # a vCPU thread's CFS weight then is about a tenth of the platform's processes'


def vmm_pids(directory: Path) -> list[int]:
    """QEMU processes whose command line names a file under `directory` (a VM's run directory):
    found this way they can be killed even when nothing else about them is known."""
    needle = f"{directory}/".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.startswith(b"qemu-system") and needle in cmdline:
                pids.append(int(proc.name))
    return pids


class VMMProcess:
    def __init__(self, pid: int, pidfd: int, is_child: bool) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._is_child = is_child
        self.returncode: int | None = None  # like Popen: negative for a signal
        self._exited = asyncio.Event()
        self._watching = False

    @classmethod
    def spawn(
        cls, argv: list[str], log_path: Path, fds: dict[int, int], jail: Confinement | None = None
    ) -> VMMProcess:
        """Start `argv` in a session of its own, in `jail` if given, with our descriptors `fds`
        (child fd: ours) and its output appended to `log_path`."""
        actions: list[tuple[Any, ...]] = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, str(log_path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        # Ours first moved above every child fd, so that no dup2 overwrites one still to come.
        high = {
            child: fcntl.fcntl(ours, fcntl.F_DUPFD_CLOEXEC, HIGH_FD) for child, ours in fds.items()
        }
        try:
            for child_fd, ours in high.items():
                actions.append((os.POSIX_SPAWN_DUP2, ours, child_fd))
            if jail is not None:
                # The jail's launcher sets the VMM's nice value itself.
                path, command = sys.executable, jail.command(argv)
            else:
                nice = shutil.which("nice")
                if shutil.which(argv[0]) is None or nice is None:
                    raise VMMError(f"{argv[0]} or nice not found")
                # nice execs the VMM in place (same pid, the VMM's own command line).
                path, command = nice, ["nice", "-n", str(VMM_NICE), *argv]
            pid = os.posix_spawn(path, command, dict(os.environ), file_actions=actions, setsid=True)
        finally:
            for ours in high.values():
                os.close(ours)
        return cls(pid, os.pidfd_open(pid), is_child=True)

    @classmethod
    def adopt(cls, pid: int, expect_in_cmdline: str) -> VMMProcess:
        """Take over a VMM an earlier worker left; `expect_in_cmdline` guards against pid reuse."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise VMGone(f"VMM process {pid} is gone") from None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmdline = ""
        if expect_in_cmdline not in cmdline:
            os.close(pidfd)
            raise VMGone(f"process {pid} is not this VM's VMM any more")
        return cls(pid, pidfd, is_child=False)

    @property
    def alive(self) -> bool:
        return not self._exited.is_set()

    def signal(self, signum: int) -> None:
        """Signal the VMM's whole session (it leads it), so no helper process is left behind."""
        if self._exited.is_set():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def wait(self) -> int | None:
        """Until the process has exited; its return code where we can know it."""
        if not self._watching:
            self._watching = True
            loop = asyncio.get_running_loop()
            loop.add_reader(self._pidfd, self._on_exit)
        await self._exited.wait()
        return self.returncode

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        if self._is_child:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self.pid, 0)
                self.returncode = (
                    -os.WTERMSIG(status) if os.WIFSIGNALED(status) else (os.WEXITSTATUS(status))
                )
        os.close(self._pidfd)
        self._exited.set()

"""Named network namespaces without forking: a short-lived thread enters (or creates) one.

`setns`/`unshare(CLONE_NEWNET)` change only the calling thread, so each call runs its work on a
fresh thread that is thrown away afterwards; sockets and child processes made there live in that
namespace. Namespaces are bind-mounted at /run/netns/NAME, where `ip netns` finds them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

NETNS_DIR = Path("/run/netns")
CLONE_NEWNET = 0x40000000
MS_BIND = 4096
MS_REC = 16384
MS_SHARED = 1 << 20
MNT_DETACH = 2

T = TypeVar("T")

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_dir_lock = threading.Lock()


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _ensure_dir() -> None:
    # As iproute2 does: /run/netns is a shared bind mount, so a namespace mounted there is seen
    # by every mount namespace (and `ip netns exec`) at once.
    with _dir_lock:
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        if _libc.mount(b"", str(NETNS_DIR).encode(), b"none", MS_SHARED | MS_REC, None) == 0:
            return
        path = str(NETNS_DIR).encode()
        _check(_libc.mount(path, path, b"none", MS_BIND | MS_REC, None), "bind /run/netns")
        _check(_libc.mount(b"", path, b"none", MS_SHARED | MS_REC, None), "share /run/netns")


def _run_thread(fn: Callable[[], T]) -> T:
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=target, name="netns")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def create(name: str, then: Callable[[], T]) -> T:
    """Create namespace `name` and run `then` inside it (on a thread of its own)."""
    _ensure_dir()
    path = NETNS_DIR / name

    def work() -> T:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
        os.close(fd)
        try:
            _check(_libc.unshare(CLONE_NEWNET), "unshare")
            source = f"/proc/self/task/{threading.get_native_id()}/ns/net".encode()
            _check(_libc.mount(source, str(path).encode(), b"none", MS_BIND, None), "mount")
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return then()

    return _run_thread(work)


def run_in(name: str, fn: Callable[[], T]) -> T:
    """Run `fn` on a thread inside namespace `name`."""

    def work() -> T:
        fd = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            _check(_libc.setns(fd, CLONE_NEWNET), f"setns {name}")
        finally:
            os.close(fd)
        return fn()

    return _run_thread(work)


def remove(name: str) -> bool:
    """Unmount and delete namespace `name`; False if there was none. Its links go with it."""
    path = NETNS_DIR / name
    if not path.exists():
        return False
    _libc.umount2(str(path).encode(), MNT_DETACH)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    return True


def names(prefix: str) -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []

"""What every part of the guest agent uses: logging, errors for the host, argument checks."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from . import protocol as p

Json = dict[str, Any]
T = TypeVar("T")

GATHER_S = 0.001  # the pause after a short read of a tenant's bytes, before the next


def log(msg: str) -> None:
    print(f"space-agent: {msg}", file=sys.stderr, flush=True)


class OpError(Exception):
    """An operation failed in a way the host should be told about."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def os_error(e: OSError, path: str) -> OpError:
    codes = {
        errno.ENOENT: p.ErrorCode.NOT_FOUND,
        errno.EEXIST: p.ErrorCode.EXISTS,
        errno.ENOTDIR: p.ErrorCode.NOT_A_DIRECTORY,
        errno.EISDIR: p.ErrorCode.IS_A_DIRECTORY,
        errno.ENOTEMPTY: p.ErrorCode.NOT_EMPTY,
        errno.EACCES: p.ErrorCode.PERMISSION_DENIED,
        errno.EPERM: p.ErrorCode.PERMISSION_DENIED,
        errno.EROFS: p.ErrorCode.PERMISSION_DENIED,
        errno.ENOSPC: p.ErrorCode.NO_SPACE,
        errno.EDQUOT: p.ErrorCode.NO_SPACE,
        errno.EBUSY: p.ErrorCode.BUSY,
    }
    code = codes.get(e.errno or 0, p.ErrorCode.INTERNAL)
    return OpError(code, f"{path}: {e.strerror or e}")


def str_arg(req: Json, key: str, required: bool = True, default: str = "") -> str:
    value = req.get(key, default)
    if (required and key not in req) or not isinstance(value, str):
        raise OpError(p.ErrorCode.INVALID, f"{key!r} must be a string")
    return value


def path_arg(req: Json) -> str:
    return check_path(str_arg(req, "path"))


def list_arg(req: Json, key: str, limit: int) -> list[Any]:
    value = req.get(key)
    if not isinstance(value, list) or len(value) > limit:
        raise OpError(p.ErrorCode.INVALID, f"{key!r} must be a list of at most {limit} items")
    return value


def check_path(path: object, what: str = "path") -> str:
    if not isinstance(path, str) or not path.startswith("/"):
        raise OpError(p.ErrorCode.INVALID, f"{what} must be an absolute path, got {path!r}")
    if "\0" in path:
        raise OpError(p.ErrorCode.INVALID, f"{what} contains a NUL byte")
    return path


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a thread of its own, so the agent goes on serving meanwhile.

    Not a pool: a call the guest makes hang for ever (a sync stuck on a dead FUSE mount) must
    not take a worker thread that the next platform duty would need."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, daemon=True, name=getattr(fn, "__name__", "blocking")).start()
    return await done


async def gather_more(ended: asyncio.Event) -> None:
    """A pause after a short read of what a tenant's process sends (its output, a socket of
    its): the agent outweighs tenant processes (see `reserve`) and so wakes for each of their
    writes; the pause lets a writer mid-burst fill its pipe or socket, so a burst goes to the
    host in a few large frames rather than thousands of small ones. `ended` cuts it short."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ended.wait(), GATHER_S)

"""What every part of the guest agent uses: logging, errors for the host, argument checks."""

from __future__ import annotations

import errno
import sys
from typing import Any

from . import protocol as p

Json = dict[str, Any]


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
        errno.ENOSPC: p.ErrorCode.NO_SPACE,
        errno.EDQUOT: p.ErrorCode.NO_SPACE,
    }
    code = codes.get(e.errno or 0, p.ErrorCode.INTERNAL)
    return OpError(code, f"{path}: {e.strerror or e}")


def str_arg(req: Json, key: str, required: bool = True, default: str = "") -> str:
    value = req.get(key, default)
    if (required and key not in req) or not isinstance(value, str):
        raise OpError(p.ErrorCode.INVALID, f"{key!r} must be a string")
    return value


def path_arg(req: Json) -> str:
    path = str_arg(req, "path")
    if not path.startswith("/"):
        raise OpError(p.ErrorCode.INVALID, f"path must be absolute, got {path!r}")
    if "\0" in path:
        raise OpError(p.ErrorCode.INVALID, "path contains a NUL byte")
    return path

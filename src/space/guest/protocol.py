"""The wire protocol between a worker and the guest agent (standard library only).

One byte stream (virtio-serial, vsock or a unix socket) carries many concurrent operations.
Everything on it is a frame:

    magic "SP" | type: u8 | flags: u8 | channel: u32 | length: u32 | payload (length bytes)

The host opens a channel by sending a REQUEST (a JSON object with an "op") on a channel id it
has not used on this connection; data for that operation then flows as STDIN/STDOUT/STDERR/DATA
frames on the same channel, END marks the end of one direction's data, and the agent closes the
channel with one REPLY (JSON: the result, or {"error": {"code", "message"}}).

A connection starts with HELLO (the per-sandbox token and a nonce) and the agent's WELCOME
echoing the nonce. A VM snapshot can cut a frame in half, and a half frame's length would make a
decoder swallow whatever follows; so the host does not decode until it has found the exact bytes
of the WELCOME for its nonce (`welcome_frame`), and the agent starts a fresh decoder for every
connection. The magic lets a decoder skip stray bytes between frames.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Iterator
from typing import Any

MAGIC = b"SP"
HEADER = struct.Struct("!2sBBII")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 1 << 20
CHUNK_SIZE = 256 * 1024
PROTOCOL_VERSION = 1
AGENT_PORT_NAME = "space.agent"  # virtio-serial port name the agent looks for
AGENT_VSOCK_PORT = 1024


class FrameType(enum.IntEnum):
    HELLO = 1  # host -> agent: {"token", "nonce"}
    WELCOME = 2  # agent -> host: {"nonce", "version", ...} or {"error": ...}
    REQUEST = 3  # host -> agent: {"op": ..., ...}; opens the channel
    REPLY = 4  # agent -> host: final result; closes the channel
    EVENT = 5  # agent -> host: progress within an operation (e.g. process started)
    CONTROL = 6  # host -> agent: {"signal": n} or {"resize": [rows, cols]}
    STDIN = 7
    STDOUT = 8
    STDERR = 9
    DATA = 10  # file contents, either direction
    END = 11  # no more STDIN/DATA in this direction


class ErrorCode(enum.StrEnum):
    NOT_FOUND = "not_found"
    EXISTS = "exists"
    NOT_A_DIRECTORY = "not_a_directory"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_EMPTY = "not_empty"
    PERMISSION_DENIED = "permission_denied"
    INVALID = "invalid"
    UNAUTHENTICATED = "unauthenticated"
    NO_SPACE = "no_space"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


def encode(ftype: FrameType, channel: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, ftype, 0, channel, len(payload)) + payload


def encode_json(ftype: FrameType, channel: int, obj: Any) -> bytes:
    return encode(ftype, channel, json.dumps(obj, separators=(",", ":")).encode())


def decode_json(payload: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"invalid JSON payload: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("JSON payload is not an object")
    return obj


def error_body(code: ErrorCode | str, message: str) -> dict[str, Any]:
    return {"error": {"code": str(code), "message": message}}


def welcome_frame(nonce: str, accepted: bool) -> bytes:
    """The agent's whole answer to a HELLO, byte for byte predictable from the nonce."""
    body: dict[str, Any] = {"nonce": nonce}
    if not accepted:
        body.update(error_body(ErrorCode.UNAUTHENTICATED, "wrong token"))
    return encode_json(FrameType.WELCOME, 0, body)


class FrameDecoder:
    """Incremental decoder: feed bytes, get whole frames; skips garbage up to the next magic."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.skipped = 0  # bytes discarded while resynchronising

    def feed(self, data: bytes) -> Iterator[tuple[FrameType, int, bytes]]:
        self._buf += data
        while True:
            if len(self._buf) < HEADER_SIZE:
                return
            if self._buf[:2] != MAGIC or self._buf[2] not in _VALID_TYPES:
                self._resync()
                continue
            _, ftype, _flags, channel, length = HEADER.unpack_from(self._buf)
            if length > MAX_PAYLOAD:
                self._resync()
                continue
            end = HEADER_SIZE + length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[HEADER_SIZE:end])
            del self._buf[:end]
            yield FrameType(ftype), channel, payload

    def _resync(self) -> None:
        at = self._buf.find(MAGIC, 1)
        drop = at if at > 0 else max(len(self._buf) - 1, 1)
        self.skipped += drop
        del self._buf[:drop]


_VALID_TYPES = frozenset(int(t) for t in FrameType)

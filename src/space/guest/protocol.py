"""The wire protocol between a worker and the guest agent (standard library only).

One byte stream (virtio-serial, vsock or a unix socket) carries many concurrent operations.
Everything on it is a frame:

    magic "SP" | type: u8 | flags: u8 | channel: u32 | length: u32 | payload (length bytes)

The host opens a channel by sending a REQUEST (a JSON object with an "op") on a channel id it
has not used on this connection; data for that operation then flows as STDIN/STDOUT/STDERR/DATA
frames on the same channel, END marks the end of one direction's data, and the agent closes the
channel with one REPLY (JSON: the result, or {"error": {"code", "message"}}, `code` one of
ErrorCode).

A connection starts with HELLO (the per-sandbox token and a nonce) and the agent's WELCOME
echoing the nonce. A VM snapshot can cut a frame in half, and a half frame's length would make a
decoder swallow whatever follows; so the host does not decode until it has found the exact bytes
of the WELCOME for its nonce (`welcome_frame`), and the agent starts a fresh decoder for every
connection. The magic lets the agent's decoder skip stray bytes between frames; the host's is
strict from the WELCOME on (the stream is in step there), and drops a connection that breaks it.

Limits. No frame is longer than MAX_PAYLOAD, no REPLY or EVENT longer than MAX_JSON: the agent
never sends one (a result too large becomes an "internal" error), and the host refuses one (it
drops the connection, never buffering the rest). The guest belongs to the tenant, who may have
taken its agent over: the host holds it to these limits rather than trusting it to keep them.

Operations ("op", then the request's fields; → the REPLY; ⇄ what flows on the channel):

  ping, info                         → {} | {kernel, hostname, boot_id, time_ns, uptime_s, ...}
  exec {argv | cmd, env?, cwd?, user?, timeout?, stdin?, pty?, rows?, cols?, max_output?}
      ⇄ EVENT {pid, window?} first; STDOUT/STDERR out, STDIN/END in, CONTROL {signal} | {resize};
        with `window`, EVENT {ack: n} once n bytes of STDIN reached the process (a host keeps
        at most `window` bytes unacknowledged: input waits for a slow reader on the host)
      → {exit_code, signal, timed_out, truncated, duration_ms}. With max_output, the process is
        killed once a stream passed that many bytes, which is where that stream is cut.
        CONTROL {detach} ends the channel with {detached, pid} and leaves the process running.
        With background (or a tag), its latest output (1 MiB) also waits for an attach;
        with detach too, the REPLY (the process as `processes` lists it) comes at once. A tag
        names one running process.
  attach {pid | tag, replay? (true)}  ⇄ EVENT {pid, tag, running, dropped?} first, the ring's
        output, then as exec → exec's result, or {detached, pid}
  processes                          → {processes: [{pid, tag, cmd | argv, cwd, pty, background,
        started_at, running, exit_code, signal}]}: running ones and the last 32 background ones
        that ended
  control {pid | tag, stdin? (base64), eof?, signal?, resize? [rows, cols]}  → {}
  read_file {path}                   ⇄ EVENT {size}, DATA…, END → {size}
  write_file {path, mode?, make_parents?}  ⇄ EVENT {ready, window}, DATA… END in → {size}
        (atomic); EVENT {ack: n} once n bytes were written, `window` unacknowledged at most
  list_dir {path, limit? (1-10000, 1000)}  → {entries, truncated}: in name order, at most
        `limit` and as many as fit MAX_JSON
  stat, remove {recursive?}, mkdir {parents?, mode?} {path}  → an entry | {}
  rename {path, to, overwrite?}      → the entry at `to`; EEXIST (exists) unless overwrite
  watch {path, recursive? (false)}  ⇄ EVENT {watching, recursive} first, then EVENT {events:
        [{type: create | write | remove | rename | chmod | overflow, path, is_dir}]}; CONTROL
        {stop} or END ends it → {events: n, ended: stopped | removed | moved | gone}
  identity {time_ns?, entropy?, hostname?, token?}, shutdown   (inside a VM only)

Platform duties: the worker's own work in the guest, built into the agent and done with system
calls (never a program of the guest's, which the tenant may have replaced; see `storage`,
`trust`, `tcp`). All but sync and tcp_connect only work inside a VM.

  sync {paths?}                      → {}: sync(2); with `paths`, syncfs(2) of each one's file
        system (a directory, not followed if a link)
  mount_volumes {volumes: [{serial, target, read_only}]}  → {mounted: [{serial, target,
        device, read_only}]}: the virtio disk with that serial, ext4, "rw" or ro+"noload"; a disk
        of size 0 (an empty slot at snapshot time) is re-probed first; stops at the first error
  unmount {targets}                  → {unmounted: [...], failed: {target: {code, message}}}:
        syncfs then umount2 (no link followed), every mount stacked on the target
  grow_root_fs {min_size?}           → {disk_bytes, block_size, fs_bytes_before, fs_bytes}:
        EXT4_IOC_RESIZE_FS of / to its disk's size, once the disk is at least min_size bytes
  seal_root_fs {trim? (true)}         → {trimmed_bytes, read_only}: FITRIM of / (best effort),
        syncfs, remount / read-only (best effort: false if something holds a file open), sync
  freeze_root_fs {trim? (true)}       → {trimmed_bytes}: FITRIM of / (best effort), then FIFREEZE:
        / flushed with an empty journal, its writes held (a build step's disk copied meanwhile)
  thaw_root_fs {}                    → {thawed}: FITHAW of / (false: it was not frozen)
  end_processes {}                   → {ended}: SIGKILL to every process the agent started and
        their descendants (cgroup.kill of tenant/), waited for (false: some outlived the wait)
  install_ca {pem}                   → {ca, bundle, bundle_size, system_bundle}:
        /etc/space/ca.pem and ca-bundle.pem (the system bundle, then the CA), atomic, root 0644
  tcp_connect {port, host? (127.0.0.1; an address of the guest), timeout?}
      ⇄ EVENT {connected} first; DATA both ways, END half-closes a direction; EVENT {ack: n}
        from the agent and CONTROL {ack: n} from the host return window (TCP_WINDOW bytes in
        flight each way at most); CONTROL {close: true} aborts
      → {sent, received, reset, closed} once both directions ended
"""

from __future__ import annotations

import enum
import json
import struct
from collections import deque
from collections.abc import Iterator
from typing import Any

MAGIC = b"SP"
HEADER = struct.Struct("!2sBBII")
HEADER_SIZE = HEADER.size
MAX_PAYLOAD = 1 << 20  # no frame is larger; a host refuses one whose header says more
MAX_JSON = 256 * 1024  # no REPLY or EVENT is larger
CHUNK_SIZE = 256 * 1024
TCP_WINDOW = 1 << 20  # bytes of a tcp_connect channel in flight in either direction
DATA_WINDOW = 1 << 20  # bytes of a file or of a process's input in flight towards the agent
PROTOCOL_VERSION = 4
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
    BUSY = "busy"
    CONNECTION_REFUSED = "connection_refused"
    TIMEOUT = "timeout"
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
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
        raise ProtocolError(f"invalid JSON payload: {type(e).__name__}: {e}") from None
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
    """Incremental decoder: feed bytes, get whole frames; skips garbage up to the next magic.

    `strict` (the host, once it has found its WELCOME: the stream is in step from there on)
    raises ProtocolError instead of skipping, so a bad header is never waited out; no frame
    longer than `max_payload` is ever buffered either way.

    What is fed is kept as it came, unjoined: a payload is copied once, when it is whole (not
    at all if it came as one piece), which is what bounds the agent's input under TCG."""

    def __init__(self, *, strict: bool = False, max_payload: int = MAX_PAYLOAD) -> None:
        self._parts: deque[bytes] = deque()  # fed and not yet decoded, from `_at` of the first
        self._at = 0
        self._size = 0
        self._strict = strict
        self._max_payload = max_payload
        self.skipped = 0  # bytes discarded while resynchronising

    def feed(self, data: bytes) -> Iterator[tuple[FrameType, int, bytes]]:
        if data:
            self._parts.append(data)
            self._size += len(data)
        while self._size >= HEADER_SIZE:
            head = self._peek(HEADER_SIZE)
            if head[:2] != MAGIC or head[2] not in _VALID_TYPES:
                if self._strict:
                    raise ProtocolError(f"not a frame header: {head!r}")
                self._resync()
                continue
            _, ftype, _flags, channel, length = HEADER.unpack_from(head)
            if length > self._max_payload:
                if self._strict:
                    raise ProtocolError(
                        f"a frame of {length} bytes, more than the {self._max_payload} allowed"
                    )
                self._resync()
                continue
            if self._size < HEADER_SIZE + length:
                return
            self._drop(HEADER_SIZE)
            yield FrameType(ftype), channel, self._take(length)

    def _peek(self, n: int) -> bytes:
        first = self._parts[0]
        if len(first) - self._at >= n:
            return first[self._at : self._at + n]
        return b"".join(self._pieces(n))

    def _take(self, n: int) -> bytes:
        """The next `n` bytes (n <= what is held), dropped from what is held."""
        if n == 0:
            return b""
        first = self._parts[0]
        if self._at == 0 and len(first) == n:  # a whole piece: no copy
            self._parts.popleft()
            self._size -= n
            return first
        taken = b"".join(self._pieces(n))
        self._drop(n)
        return taken

    def _drop(self, n: int) -> None:
        self._size -= n
        while n:
            left = len(self._parts[0]) - self._at
            if n < left:
                self._at += n
                return
            n -= left
            self._parts.popleft()
            self._at = 0

    def _pieces(self, n: int) -> Iterator[memoryview]:
        at = self._at
        for part in self._parts:
            if n <= 0:
                return
            piece = memoryview(part)[at : at + n]
            yield piece
            n -= len(piece)
            at = 0

    def _resync(self) -> None:
        """Skip to the next magic: searched within the first piece (joined with the next where
        the magic could straddle them), so a stream of junk costs time in its length."""
        if len(self._parts) > 1 and len(self._parts[0]) - self._at < len(MAGIC):
            first, second = self._parts.popleft(), self._parts.popleft()
            self._parts.appendleft(first[self._at :] + second)
            self._at = 0
        first = self._parts[0]
        at = first.find(MAGIC, self._at + 1)
        drop = at - self._at if at >= 0 else max(len(first) - self._at - 1, 1)
        self.skipped += drop
        self._drop(drop)


_VALID_TYPES = frozenset(int(t) for t in FrameType)

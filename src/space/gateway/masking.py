"""Secrets echoed back by an origin, overwritten before the guest reads them.

A value is replaced by as many `*` (lengths, and so framing, stay as they were). A body arrives
in pieces: the last len(value) - 1 bytes of each are held back until the next, so a value split
between two pieces is still whole when it is searched for. Where masking applies the gateway asks
for an unencoded, whole body; a body encoded anyway is decoded here (gzip, deflate) to be
searched, and any other encoding is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from space.gateway.policy import Policy

# gzip and deflate both decode with zlib's header detection (gzip or zlib wrapper).
DECODABLE = frozenset({"gzip", "x-gzip", "deflate"})
MAX_CODINGS = 2
ENCODING_HEADERS = frozenset({b"content-encoding", b"content-length"})
PIECE = 65536  # the most a decoder hands on at once, however much a compressed byte expands


class Unmaskable(Exception):
    """A response the gateway could not search whole for echoed secrets."""


def values_for(policy: Policy, name: str) -> list[bytes]:
    """What must never come back from `name`: the value of every secret bound to it (an origin
    may echo one it got earlier, on another request, as well as this request's)."""
    return [s.value.encode() for s in policy.secrets if s.value and s.bound_to(name)]


class Masker:
    def __init__(self, values: list[bytes]) -> None:
        self.values = sorted(
            values, key=len, reverse=True
        )  # a longer value first: it may hold a shorter
        self.keep = max(len(v) for v in values) - 1
        self._held = b""

    def mask(self, data: bytes) -> bytes:
        for value in self.values:
            data = data.replace(value, b"*" * len(value))
        return data

    def feed(self, data: bytes) -> bytes:
        """What of the body so far can go to the guest now."""
        data = self.mask(self._held + data)
        cut = max(0, len(data) - self.keep)
        self._held = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        """The rest, at the end of the body."""
        data, self._held = self._held, b""
        return data


def screen(
    masker: Masker, status: int, headers: list[tuple[bytes, bytes]]
) -> tuple[list[tuple[bytes, bytes]], Decoder | None]:
    """A masked response's headers as the guest may see them, and the decoder its body needs."""
    if status == 206:
        # Asked for no range, the origin sent one: a value split over two could not be found.
        raise Unmaskable("a partial response (206)")
    applied = codings([v for k, v in headers if k.lower() == b"content-encoding"])
    decoder = Decoder(applied) if applied else None
    if decoder is not None:  # the guest gets the decoded body, of a length not known yet
        headers = [(k, v) for k, v in headers if k.lower() not in ENCODING_HEADERS]
    return [(k, masker.mask(v)) for k, v in headers], decoder


def codings(header_values: list[bytes]) -> list[str]:
    """The content codings of a response, in the order they were applied (identity left out)."""
    out = [c.strip().lower() for v in header_values for c in v.decode("latin-1").split(",")]
    return [c for c in out if c and c != "identity"]


class Decoder:
    """A body's content codings undone as it streams, in pieces of at most PIECE bytes."""

    def __init__(self, applied: list[str]) -> None:
        unknown = [c for c in applied if c not in DECODABLE]
        if unknown:
            raise Unmaskable(f"Content-Encoding {', '.join(unknown)}")
        if len(applied) > MAX_CODINGS:
            raise Unmaskable(f"{len(applied)} content codings")
        self._stages = [_Inflate() for _ in applied]

    def feed(self, data: bytes) -> Iterator[bytes]:
        return self._through(0, data)

    def _through(self, stage: int, data: bytes) -> Iterator[bytes]:
        if stage == len(self._stages):
            yield data
            return
        for piece in self._stages[stage].feed(data):
            yield from self._through(stage + 1, piece)


class _Inflate:
    def __init__(self) -> None:
        self._z = zlib.decompressobj(32 + zlib.MAX_WBITS)

    def feed(self, data: bytes) -> Iterator[bytes]:
        while True:
            try:
                out = self._z.decompress(data, PIECE)
            except zlib.error as e:
                raise Unmaskable(f"a body that does not decode: {e}") from None
            if out:
                yield out
            if self._z.eof:
                # gzip allows several members one after another; each is searched too.
                data = self._z.unused_data
                self._z = zlib.decompressobj(32 + zlib.MAX_WBITS)
                if not data:
                    return
            else:
                data = self._z.unconsumed_tail
                if not data and len(out) < PIECE:  # a full piece may have more behind it
                    return

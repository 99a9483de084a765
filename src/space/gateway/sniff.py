"""The server name in the first bytes of a TLS connection (its ClientHello's SNI)."""

from __future__ import annotations

import struct


class Incomplete(Exception):
    """More bytes are needed."""


def tls_sni(data: bytes) -> str | None:
    """The server name of a TLS ClientHello; None if it has none; Incomplete if cut short."""
    if len(data) < 5:
        raise Incomplete
    if data[0] != 0x16:
        raise ValueError("not a TLS handshake")
    (length,) = struct.unpack("!H", data[3:5])
    if len(data) < 5 + length:
        raise Incomplete
    body = data[5 : 5 + length]
    try:
        if body[0] != 1:
            raise ValueError("not a ClientHello")
        pos = 4 + 2 + 32  # handshake header, version, random
        pos += 1 + body[pos]  # session id
        (n,) = struct.unpack("!H", body[pos : pos + 2])
        pos += 2 + n  # cipher suites
        pos += 1 + body[pos]  # compression methods
        (ext_total,) = struct.unpack("!H", body[pos : pos + 2])
        pos += 2
        end = min(pos + ext_total, len(body))
        while pos + 4 <= end:
            ext_type, ext_len = struct.unpack("!HH", body[pos : pos + 4])
            pos += 4
            if ext_type == 0:  # server_name
                ext = body[pos : pos + ext_len]
                (list_len,) = struct.unpack("!H", ext[:2])
                i = 2
                while i + 3 <= 2 + list_len:
                    kind = ext[i]
                    (name_len,) = struct.unpack("!H", ext[i + 1 : i + 3])
                    if kind == 0:
                        return ext[i + 3 : i + 3 + name_len].decode("ascii")
                    i += 3 + name_len
                return None
            pos += ext_len
    except (IndexError, struct.error, UnicodeDecodeError):
        raise ValueError("malformed ClientHello") from None
    return None

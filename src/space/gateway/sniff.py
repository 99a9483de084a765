"""Names from the first bytes of a connection: TLS ClientHello SNI, HTTP/1 Host."""

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


def http_host(data: bytes) -> tuple[str, str]:
    """(method, Host without port) of an HTTP/1 request head; Incomplete if cut short."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > 65536:
            raise ValueError("request head too large")
        raise Incomplete
    lines = data[:end].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1 request")
    hosts = [
        v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "host"
    ]
    if len(hosts) != 1:
        raise ValueError("an HTTP request needs exactly one Host header")
    return parts[0], strip_port(hosts[0])


def strip_port(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        return host.rsplit(":", 1)[0].rstrip(".")
    return host.rstrip(".")

"""Request heads from guests: parsed by h11 after a strict check of the raw bytes, checked against
the connection's name, and rebuilt (never forwarded as the guest wrote them).

h11 tolerates things an origin behind the gateway may read differently (bare LF line ends,
obs-fold, a repeated Content-Length, Transfer-Encoding beside Content-Length): each could make
the origin see a request the gateway never checked (request smuggling), so each is refused.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

import h11

from space.gateway.policy import Policy, Secret

MAX_HEAD = 65536
# Where h11 ends a head: the first empty line, with or without its CR.
HEAD_END = re.compile(rb"\n\r?\n")
# Never forwarded: they describe one hop, or the gateway answers them itself (Expect).
HOP_HEADERS = frozenset({
    "connection", "proxy-connection", "keep-alive", "proxy-authorization", "proxy-authenticate",
    "te", "trailer", "transfer-encoding", "upgrade", "expect",
})  # fmt: skip
# Dropped where responses are masked: the gateway chooses the encoding and wants whole bodies.
MASKING_HEADERS = frozenset({"accept-encoding", "range", "if-range"})


class Refused(Exception):
    """A request (or connection) the gateway will not serve; `status` for the guest's answer."""

    def __init__(self, reason: str, status: int = 403, address: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.address = address


def head_length(buffer: bytes | bytearray, start: int = 0) -> int | None:
    """Length of the head at the start of `buffer` (its end searched for from `start`), or
    None if it is not complete yet."""
    match = HEAD_END.search(buffer, start)
    return None if match is None else match.end()


def check_raw(head: bytes) -> None:
    """Refuse a head whose bytes h11 would accept but another parser could split differently."""
    if b"\0" in head:
        raise Refused("NUL in the request head", 400)
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf:
        raise Refused("bare LF in the request head (request smuggling)", 400)
    if head.count(b"\r") != crlf:
        raise Refused("bare CR in the request head (request smuggling)", 400)
    names = []
    for line in head[:-4].split(b"\r\n")[1:]:
        if line[:1] in (b" ", b"\t"):
            raise Refused("obs-fold (a folded header line) in the request head", 400)
        name, _, value = line.partition(b":")
        names.append(name.strip().lower())
        if name.strip().lower() == b"content-length" and b"," in value:
            raise Refused("a list in Content-Length (request smuggling)", 400)
    if names.count(b"content-length") > 1:
        raise Refused("more than one Content-Length (request smuggling)", 400)
    if names.count(b"host") > 1:
        raise Refused("more than one Host header", 400)
    if b"content-length" in names and b"transfer-encoding" in names:
        raise Refused("both Transfer-Encoding and Content-Length (request smuggling)", 400)


def parse(head: bytes, rest: bytes) -> tuple[h11.Connection, h11.Request]:
    """h11's server side of one request: its head parsed; `rest` (body, pipelined requests)
    left in it for the caller to read as events."""
    check_raw(head)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(head + rest)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as e:
        raise Refused(f"malformed request: {e}", 400) from None
    if not isinstance(event, h11.Request):
        raise Refused("malformed request", 400)
    return conn, event


def split_host(value: str) -> tuple[str, int | None]:
    """(name, port or None) of a Host header or an authority; ValueError if malformed."""
    parts = urllib.parse.urlsplit("//" + value)
    if parts.username is not None or parts.password is not None or not parts.hostname:
        raise ValueError(value)
    return parts.hostname.rstrip(".").lower(), parts.port


@dataclass(frozen=True)
class Checked:
    method: str
    target: str  # origin-form: what the origin gets, whatever form the guest used
    host: str  # the Host header as the guest sent it


def check(request: h11.Request, name: str | None, port: int, tls: bool) -> tuple[str, Checked]:
    """(the name the request is for, its checked parts). `name`: what the connection is bound to
    (the SNI, or the first request's Host); None for the first plain HTTP request."""
    method = request.method.decode("ascii")
    if method == "CONNECT":
        raise Refused("CONNECT is not served")
    hosts = [v.decode("latin-1") for k, v in request.headers if k == b"host"]
    if len(hosts) != 1:
        raise Refused("a request needs exactly one Host header", 400)
    try:
        host, host_port = split_host(hosts[0])
    except ValueError:
        raise Refused("malformed Host header", 400) from None
    if host_port not in (None, port):
        raise Refused(f"Host port {host_port} is not the connection's port {port}")
    target = request.target.decode("latin-1")
    if target.startswith("/"):
        pass
    elif target.lower().startswith(("http://", "https://")):
        target = _origin_form(target, host, host_port, tls)
    else:
        raise Refused("request target must be a path or an absolute URI", 400)
    if name is not None and host != name:
        raise Refused(f"Host {host!r} does not match {'SNI' if tls else 'the connection'} {name!r}")
    return host, Checked(method, target, hosts[0])


def _origin_form(target: str, host: str, host_port: int | None, tls: bool) -> str:
    parts = urllib.parse.urlsplit(target)
    if "@" in parts.netloc:
        # `http://allowed:80@other/`: a parser that ignores userinfo would check `allowed`.
        raise Refused("userinfo in the request target", 400)
    if parts.scheme.lower() != ("https" if tls else "http"):
        raise Refused("request target's scheme is not the connection's", 400)
    try:
        authority, authority_port = split_host(parts.netloc)
    except ValueError:
        raise Refused("malformed request target", 400) from None
    if authority != host or authority_port != host_port:
        raise Refused("request target and Host disagree", 400)
    return urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))


def rewrite(
    policy: Policy, name: str, tls: bool, request: h11.Request, checked: Checked, masked: bool
) -> tuple[h11.Request, list[str]]:
    """The request to send upstream, built from the parsed fields: placeholders swapped, header
    secrets added, hop headers dropped; with `masked`, the encoding left to the gateway. Also
    the names of the secrets used. Secrets are used only over TLS to a bound host."""
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw_items()]
    # Headers the guest's Connection names are hop-by-hop too.
    hop = HOP_HEADERS | {
        t.strip().lower() for k, v in headers if k.lower() == "connection" for t in v.split(",")
    }
    injected: list[str] = []
    for secret in policy.secrets:
        where = placeholder_in(secret, checked.target, headers)
        if where is None:
            continue
        check_placeholder(secret, name, tls, where)
        headers = [(k, v.replace(secret.placeholder or "", secret.value)) for k, v in headers]
        injected.append(secret.name)
    extra = [
        (secret, line)
        for secret in policy.secrets
        if tls and secret.bound_to(name) and (line := secret.header_line()) is not None
    ]
    replaced = {line[0].lower() for _, line in extra} | hop
    if masked:
        replaced |= MASKING_HEADERS
    out = [(k, v) for k, v in headers if k.lower() not in replaced]
    out += [line for _, line in extra]
    if any(k == b"transfer-encoding" for k, _ in request.headers):
        out.append(("Transfer-Encoding", "chunked"))  # h11 let only `chunked` through
    injected += [secret.name for secret, _ in extra]
    if masked:
        out.append(("Accept-Encoding", "identity"))
    return h11.Request(method=checked.method, target=checked.target, headers=out), injected


def check_placeholder(secret: Secret, name: str, tls: bool, where: str) -> None:
    """Refuse a placeholder found `where`, unless that is a header value over TLS to a host
    its secret is bound to (the one place it is swapped)."""
    if not (tls and secret.bound_to(name)):
        raise Refused(f"placeholder of secret {secret.name!r} sent to a host it is not bound to")
    if where != "headers":
        # Swapped into a URL or a body, the value could be stored or echoed by the bound
        # service itself (a search, a paste, an error page): only header values get it.
        raise Refused(f"placeholder of secret {secret.name!r} outside the request headers")


def placeholder_in(secret: Secret, target: str, headers: list[tuple[str, str]]) -> str | None:
    """Where a secret's placeholder is in a head: "request target", "headers" (values only)
    or "header names"; None if nowhere."""
    p = secret.placeholder
    if not p:
        return None
    if p in target:
        return "request target"
    if any(p in k for k, _ in headers):
        return "header names"
    if any(p in v for _, v in headers):
        return "headers"
    return None

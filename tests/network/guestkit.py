"""Guest-side tools for the fairness tests and the noisy-neighbour benchmark (stdlib only; run in
a guest namespace, or a VM). Each prints one JSON object.

    guestkit.py fetch HOST COUNT [SECS [ADDR]] lookup + GET on a new connection, SECS apart
    guestkit.py flood ADDRESS PORT COUNT SECS  COUNT connections with slowloris heads, kept up
    guestkit.py dnsflood SERVER NAME SECS QPS udp|tcp   queries (QPS 0: as fast as answered)
                                               (SECS 0: until stdin ends)
    guestkit.py hold SPEC...                   open connections, then report on each "probe"
                                               line read from stdin (SPEC: http:HOST[:PORT],
                                               tls:NAME:CAFILE, tcp:ADDRESS:PORT)
"""

from __future__ import annotations

import contextlib
import json
import random
import resource
import select
import selectors
import socket
import ssl
import struct
import sys
import time
from collections.abc import Callable


def fetch(host: str, count: int, interval: float = 0.0, address: str = "") -> dict[str, object]:
    """`count` times: look HOST up (unless `address` is given: the gateway goes by the Host)
    and GET http://HOST/ on a new connection, `interval` s apart. Each one's time, lookup
    included."""
    latencies, failures = [], []
    for _ in range(count):
        start = time.perf_counter()
        try:
            to = (
                address or socket.getaddrinfo(host, 80, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
            )
            with socket.create_connection((str(to), 80), timeout=10) as s:
                s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
                reply = b""
                while data := s.recv(65536):
                    reply += data
            if reply.startswith(b"HTTP/1.1 200"):
                latencies.append(time.perf_counter() - start)
            else:
                failures.append(reply[:80].decode("latin-1"))
        except OSError as e:
            failures.append(repr(e))
        time.sleep(interval)
    return {"latencies": latencies, "failed": len(failures), "failures": failures[:5]}


def flood(address: str, port: int, count: int, seconds: float) -> dict[str, object]:
    """Keep `count` connections open for `seconds`, each sending a request head a byte a
    second (slowloris); every one the gateway closes is opened again. How many it refused at
    once (closed within 0.5 s) and how long it let the others hang on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 64)), hard))
    head = b"GET / HTTP/1.1\r\nHost: other.test\r\nX-Slow: "
    sel = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}
    lasted: list[float] = []

    def connect() -> None:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect((address, port))
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            return
        opened[s] = time.monotonic()
        sel.register(s, selectors.EVENT_WRITE)

    for _ in range(count):
        connect()
    going = _until(seconds)
    trickled = time.monotonic()
    while going():
        for key, events in sel.select(timeout=0.2):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if events & selectors.EVENT_WRITE:
                with contextlib.suppress(OSError):
                    s.send(head)
                sel.modify(s, selectors.EVENT_READ)
                continue
            # Readable: the gateway closed it, or answered (408) and is closing it.
            lasted.append(time.monotonic() - opened.pop(s))
            sel.unregister(s)
            s.close()
            connect()
        if time.monotonic() - trickled >= 1:
            trickled = time.monotonic()
            for s in opened:
                with contextlib.suppress(OSError):
                    s.send(b"x")
    for s in opened:
        s.close()
    held = [t for t in lasted if t >= 0.5]
    return {"connections": len(lasted) + len(opened), "refused": len(lasted) - len(held),
            "closed_later": len(held), "held_longest_s": max(held, default=0.0)}  # fmt: skip


def dns_flood(server: str, name: str, seconds: float, qps: float, proto: str) -> dict[str, int]:
    """A-queries for `name` for `seconds`, `qps` a second (0: each as soon as the last was
    answered), over UDP or TCP; how they were answered."""
    question = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
    counts = {"answered": 0, "refused": 0, "other": 0, "lost": 0}
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as s:
        s.settimeout(0.5)
        s.connect((server, 53))
        going = _until(seconds)
        while going():
            query = struct.pack("!HHHHHH", random.randrange(65536), 0x0100, 1, 0, 0, 0) + question
            try:
                if proto == "tcp":
                    s.sendall(len(query).to_bytes(2, "big") + query)
                    reply = s.recv(4096)[2:]
                else:
                    s.send(query)
                    reply = s.recv(4096)
            except OSError:
                counts["lost"] += 1
                continue
            rcode = reply[3] & 0x0F
            counts["answered" if rcode == 0 else "refused" if rcode == 5 else "other"] += 1
            if qps:
                time.sleep(1 / qps)
    return counts


def _until(seconds: float) -> Callable[[], bool]:
    """Whether to go on: for `seconds`, or (0) until stdin ends."""
    if seconds:
        deadline = time.monotonic() + seconds
        return lambda: time.monotonic() < deadline
    return lambda: not select.select([sys.stdin], [], [], 0)[0]


def hold(specs: list[str]) -> None:
    sockets: dict[str, socket.socket] = {}
    for spec in specs:
        kind, _, target = spec.partition(":")
        if kind == "http":  # keep-alive (to an origin that keeps it too)
            host, _, port = target.partition(":")
            s = socket.create_connection((host, int(port or 80)), timeout=5)
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            _read_response(s)
        elif kind == "tls":
            name, _, cafile = target.partition(":")
            ctx = ssl.create_default_context(cafile=cafile)
            s = ctx.wrap_socket(socket.create_connection((name, 443), timeout=5),
                                server_hostname=name)  # fmt: skip
        else:
            address, _, port = target.rpartition(":")
            s = socket.create_connection((address, int(port)), timeout=5)
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
        sockets[spec] = s
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "probe":
            break
        print(json.dumps({spec: _state(s) for spec, s in sockets.items()}), flush=True)


def _read_response(s: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))  # fmt: skip
    while len(body) < length:
        body += s.recv(65536)


def _state(s: socket.socket) -> str:
    """ "closed" if the gateway ended the connection, else "open"."""
    s.settimeout(0.3)
    try:
        return "closed" if not s.recv(1) else "data"
    except TimeoutError:
        return "open"
    except (OSError, ssl.SSLError):
        return "closed"


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "hold":
        hold(args)
        return
    out: dict[str, object]
    if command == "fetch":
        out = fetch(args[0], int(args[1]), float(args[2]) if args[2:] else 0.0, *args[3:4])
    elif command == "flood":
        out = flood(args[0], int(args[1]), int(args[2]), float(args[3]))
    else:
        out = dict(dns_flood(args[0], args[1], float(args[2]), float(args[3]), args[4]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""A webhook receiver in a network namespace of its own, reached from the host over a veth at a
documentation address (203.0.113.0/24): a "public" address as the egress floor sees it, that
only this machine routes. Run as a script inside the namespace; `Receiver` sets it all up.

Paths: `/ok` answers 200; `/flaky` 503 the first time it sees a delivery, then 200; `/slow`
answers after a minute; `/huge` answers a gibibyte. Every request is logged as a JSON line
(path, headers, body, time).
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

HOST_SIDE = "203.0.113.1"
RECEIVER = "203.0.113.2"
PORT = 8080


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class Receiver:
    log: Path
    netns: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{RECEIVER}:{PORT}"

    def start(self) -> None:
        self.netns = f"spw-{secrets.token_hex(3)}"
        host_link, ns_link = f"{self.netns}h", f"{self.netns}n"
        sh("ip", "netns", "add", self.netns)
        sh("ip", "link", "add", host_link, "type", "veth", "peer", "name", ns_link)
        sh("ip", "link", "set", ns_link, "netns", self.netns)
        sh("ip", "addr", "add", f"{HOST_SIDE}/30", "dev", host_link)
        sh("ip", "link", "set", host_link, "up")
        sh("ip", "-n", self.netns, "addr", "add", f"{RECEIVER}/30", "dev", ns_link)
        sh("ip", "-n", self.netns, "link", "set", ns_link, "up")
        sh("ip", "-n", self.netns, "link", "set", "lo", "up")
        self.log.write_text("")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, sys.executable, __file__, str(self.log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while '"ready"' not in self.log.read_text():
            assert time.monotonic() < deadline, "the receiver did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["ip", "link", "del", f"{self.netns}h"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)

    def requests(self, path: str | None = None) -> list[dict[str, Any]]:
        got = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        got = [r for r in got if r.get("path")]
        for r in got:
            r["body"] = base64.b64decode(r["body"])
        return [r for r in got if path is None or r["path"] == path]


@contextlib.contextmanager
def receiving(directory: Path) -> Iterator[Receiver]:
    r = Receiver(directory / "requests.jsonl")
    r.start()
    try:
        yield r
    finally:
        r.stop()


def serve(log: Path) -> None:
    seen: set[str] = set()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            entry = {"path": self.path, "headers": dict(self.headers), "at": time.time(),
                     "body": base64.b64encode(body).decode()}  # fmt: skip
            with lock, log.open("a") as out:
                out.write(json.dumps(entry) + "\n")
            status = 200
            if self.path == "/flaky":
                delivery = self.headers.get("Space-Delivery-Id", "")
                with lock:
                    status = 200 if delivery in seen else 503
                    seen.add(delivery)
            elif self.path == "/slow":
                time.sleep(60)
            elif self.path == "/huge":  # a gibibyte, for as long as anyone reads it
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                try:
                    for _ in range(1024):
                        self.wfile.write(b"\0" * (1 << 20))
                except OSError:
                    pass
                return
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((RECEIVER, PORT), Handler)
    with log.open("a") as out:
        out.write(json.dumps({"ready": True}) + "\n")
    server.serve_forever()


if __name__ == "__main__":
    serve(Path(sys.argv[1]))

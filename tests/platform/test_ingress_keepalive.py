"""Ingress keeps its connections to a sandbox's port alive between requests, and never lets one
answer be taken for another's: tried against a real service in a real sandbox."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from ..stack import Platform
from .helpers import create, run, wait_state

# GET /peer answers the client's port as the service sees it (one per TCP connection); GET /big
# answers 8 MiB; GET /extra answers 5 bytes and, in the same write, a second answer nobody asked
# for; GET /open answers how many connections it has open; HEAD answers as GET does, body
# included (a careless service, but a common one); POST answers the length it read. Idle
# connections are closed after IDLE seconds.
SERVICE = """
import http.server, sys, time
FORGED = b"HTTP/1.1 200 OK\\r\\nContent-Length: 6\\r\\n\\r\\nforged"
OPEN = set()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = float(sys.argv[2])
    def setup(self):
        super().setup()
        OPEN.add(self.client_address[1])
    def finish(self):
        OPEN.discard(self.client_address[1])
        super().finish()
    def answer(self, body, extra=b"", length=None):
        length = len(body) if length is None else length
        head = f"HTTP/1.1 200 OK\\r\\nContent-Length: {length}\\r\\n\\r\\n".encode()
        self.wfile.write(head + body + extra)
    def do_GET(self):
        if self.path == "/big":
            self.answer(b"x" * (8 << 20))
        elif self.path == "/extra":
            self.answer(b"hello", FORGED)
        elif self.path == "/open":
            self.answer(str(len(OPEN)).encode())
        else:
            self.answer(str(self.client_address[1]).encode())
    def do_HEAD(self):
        self.answer(b"", length=len(FORGED))
        time.sleep(0.05)
        self.wfile.write(FORGED)
    def do_POST(self):
        n = len(self.rfile.read(int(self.headers["Content-Length"])))
        self.answer(f"{n} {self.client_address[1]}".encode())
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def serve(c: httpx.Client, sid: str, port: int, idle_s: float) -> str:
    """Start the service on `port`; the ingress URL of its root."""
    r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/svc.py"},
              content=SERVICE.encode())  # fmt: skip
    assert r.status_code == 200, r.text
    run(c, sid, f"(nohup python3 /root/svc.py {port} {idle_s} >/dev/null 2>&1 &)")
    url = f"/v1/sandboxes/{sid}/ports/{port}"
    deadline = time.monotonic() + 30
    while c.get(f"{url}/peer").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    return url


def peer(c: httpx.Client, url: str) -> str:
    r = c.get(f"{url}/peer")
    assert r.status_code == 200, r.text
    return r.text


def test_requests_to_a_port_share_one_connection_until_one_is_cut(platform: Platform) -> None:
    with platform.client() as c, platform.client() as other:
        sid = create(c)["id"]
        url = serve(c, sid, 8100, idle_s=600)
        first = peer(c, url)
        # Sequential requests, from two clients of the API, with and without a body.
        assert [peer(c, url) for _ in range(4)] == [first] * 4
        assert peer(other, url) == first
        # However many times it is taken and kept again.
        assert {peer(c, url) for _ in range(300)} == {first}
        r = c.post(f"{url}/sum", content=b"y" * 100_000)
        assert r.status_code == 200 and r.text == f"100000 {first}", r.text
        # A client that leaves mid-answer ends that connection: the next gets a new one, whole.
        with c.stream("GET", f"{url}/big") as big:
            next(big.iter_raw())
        deadline = time.monotonic() + 10
        while (n := c.get(f"{url}/open").text) != "1":  # the one this asks on
            assert time.monotonic() < deadline, f"{n} connections open"
            time.sleep(0.1)
        after = peer(c, url)
        assert after != first
        assert len(c.get(f"{url}/big").content) == 8 << 20
        assert peer(c, url) == after
        # Concurrent requests each get a connection of their own, and every answer its own.
        with ThreadPoolExecutor(8) as pool:
            r = list(pool.map(lambda n: c.post(f"{url}/sum", content=b"z" * n), range(1, 9)))
        assert [x.text.split()[0] for x in r] == [str(n) for n in range(1, 9)]
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_connection_the_service_closed_while_kept_is_not_used(platform: Platform) -> None:
    """The service ends idle connections after 0.2 s (as Node's and uvicorn's do after 5 s):
    requests that come later, a POST with a body among them, are answered on a new one."""
    with platform.client() as c:
        sid = create(c)["id"]
        url = serve(c, sid, 8101, idle_s=0.2)
        seen = {peer(c, url)}
        for _ in range(3):
            time.sleep(1.0)
            r = c.post(f"{url}/sum", content=b"q" * 1000)
            assert r.status_code == 200, r.text
            count, port = r.text.split()
            assert count == "1000" and port not in seen
            seen.add(port)
        c.delete(f"/v1/sandboxes/{sid}")


def test_an_answer_that_runs_past_its_length_is_never_the_next_ones(platform: Platform) -> None:
    """A service that writes a second answer nobody asked for after the first: the next request,
    at once or later, gets its own answer, never that one."""
    with platform.client() as c:
        sid = create(c)["id"]
        url = serve(c, sid, 8102, idle_s=600)
        for pause in (0.0, 0.5):
            r = c.get(f"{url}/extra")
            assert r.status_code == 200 and r.text == "hello"
            time.sleep(pause)
            after = c.get(f"{url}/peer")
            assert after.status_code == 200 and after.text.isdigit(), after.text
            # A HEAD's answer whose body came anyway, in a write of its own.
            assert c.head(f"{url}/peer").status_code == 200
            time.sleep(pause)
            after = c.get(f"{url}/peer")
            assert after.status_code == 200 and after.text.isdigit(), after.text
        c.delete(f"/v1/sandboxes/{sid}")


def test_a_kept_connection_is_no_use_of_its_sandbox(platform: Platform) -> None:
    """A connection kept for later does not hold its sandbox awake: the idle timeout pauses it
    as if the connection were closed, and the next request wakes it and is answered."""
    with platform.client() as c:
        sid = create(c, idle_timeout_s=3)["id"]
        url = serve(c, sid, 8103, idle_s=600)
        peer(c, url)  # kept from here on
        wait_state(c, sid, "paused", timeout=30)  # long before the kept one would time out
        assert peer(c, url).isdigit()
        assert c.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
        c.delete(f"/v1/sandboxes/{sid}")

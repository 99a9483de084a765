"""Egress through the API, tried from inside a real sandbox: its policy decides what it
reaches, its secrets reach only their hosts and never its guest, a policy changes while it
runs, and every decision is in its audit log. (tests/network attacks the gateway itself,
from a namespace and from a VM; this is the same machinery wired into the platform.)"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import httpx

from ..network.world import BEARER, HEADER_SECRET
from ..stack import Platform
from .helpers import create, fetch, peak_rss_mib, run


def audit(c: httpx.Client, sandbox_id: str) -> list[dict[str, Any]]:
    r = c.get(f"/v1/sandboxes/{sandbox_id}/audit")
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def test_policy_secrets_and_audit_from_inside_a_sandbox(platform: Platform) -> None:
    with platform.client() as c:
        assert c.put("/v1/secrets/bearer", json={"value": BEARER}).status_code == 200
        assert c.put("/v1/secrets/apikey", json={"value": HEADER_SECRET}).status_code == 200
        listed = c.get("/v1/secrets").json()
        assert [s["name"] for s in listed["items"]] == ["apikey", "bearer"]
        assert BEARER not in str(listed) and HEADER_SECRET not in str(listed)

        sb = create(
            c,
            network={"hosts": [{"pattern": "allowed.test"}, {"pattern": "secret.test"}]},
            secrets=[
                {"secret": "bearer", "hosts": ["secret.test"], "env": "TOKEN"},
                {"secret": "apikey", "hosts": ["secret.test"], "header": "X-Api-Key"},
            ],
        )
        assert sb["state"] == "running", sb
        sid = sb["id"]
        assert BEARER not in str(sb) and HEADER_SECRET not in str(sb)

        # Allowed names answer; anything else does not, by name or by address.
        code, out = fetch(c, sid, "http://allowed.test/")
        assert code == 0 and out.startswith("hello from allowed.test"), out
        assert fetch(c, sid, "http://other.test/")[0] == 3
        assert fetch(c, sid, "http://198.51.100.13/")[0] == 3

        # The guest holds a placeholder; the bound host receives the real values.
        out, _, _ = run(c, sid, "echo $TOKEN; cat /proc/cmdline; cat /proc/1/environ")
        placeholder = out.decode().split()[0]
        assert placeholder.startswith("space-secret-")
        assert BEARER.encode() not in out and HEADER_SECRET.encode() not in out
        _, _, code = run(c, sid, f"grep -rqs {BEARER} /etc /root /tmp /run")
        assert code == 1  # not in the guest's files either
        code, out = fetch(c, sid, "https://secret.test/auth", f"Authorization:Bearer {placeholder}")
        assert (code, out) == (0, "auth-ok"), out
        code, out = fetch(c, sid, "https://secret.test/header")
        assert (code, out) == (0, "header-ok"), out
        # Sent anywhere else, the placeholder is stopped, not swapped.
        code, out = fetch(c, sid, "http://allowed.test/", f"Authorization:Bearer {placeholder}")
        assert code == 3, out
        seen = platform.internet.internet_events()
        assert not any(placeholder in str(e) for e in seen)
        assert all(BEARER not in str(e) or e["headers"].get("host") == "secret.test" for e in seen)

        # Every decision is in the audit log, with its reason.
        events = audit(c, sid)
        assert any(e["host"] == "other.test" and e["decision"] == "deny" for e in events), events
        assert any(e["host"] == "secret.test" and e["kind"] == "https" and e["decision"] == "allow"
                   for e in events), events  # fmt: skip

        # A new policy is in force at once.
        r = c.put(f"/v1/sandboxes/{sid}/network", json={"network": {"hosts": []}})
        assert r.status_code == 200 and r.json()["network"]["hosts"] == [], r.text
        assert fetch(c, sid, "http://allowed.test/")[0] == 3

        # A bound secret stays until its sandbox is gone.
        r = c.delete("/v1/secrets/bearer")
        assert r.status_code == 409 and sid in r.json()["detail"]
        c.delete(f"/v1/sandboxes/{sid}")
        assert c.delete("/v1/secrets/bearer").status_code == 204
        assert c.delete("/v1/secrets/apikey").status_code == 204


def test_bad_egress_requests_are_refused(platform: Platform) -> None:
    with platform.client() as c, platform.client(platform.key_b) as b:
        assert c.put("/v1/secrets/mine", json={"value": "v"}).status_code == 200
        # B cannot bind A's secret.
        r = b.post("/v1/sandboxes", json={"secrets": [{"secret": "mine", "hosts": ["x.test"],
                                                        "header": "X"}]})  # fmt: skip
        assert r.status_code == 404 and "mine" in r.json()["detail"]
        for bad in (
            {"network": {"hosts": [{"pattern": "a b"}]}},
            {"network": {"default": "maybe"}},
            {"network": {"cidrs": [{"cidr": "not-a-cidr"}]}},
            {"secrets": [{"secret": "mine", "hosts": ["x.test"]}]},  # neither header nor env
            {"secrets": [{"secret": "mine", "hosts": [], "header": "X"}]},
            {"secrets": [{"secret": "mine", "hosts": ["x.test"], "env": "1BAD"}]},
            {"secrets": [{"secret": "mine", "hosts": ["x.test"], "env": "A"}], "env": {"A": "x"}},
            {"secrets": [{"secret": "mine", "hosts": ["x.test"], "env": "A", "placeholder": "p"}]},
        ):
            r = c.post("/v1/sandboxes", json=bad)
            assert r.status_code == 422, (bad, r.text)
        for name, body, status in (("bad name", {"value": "v"}, 400), ("ok", {}, 422),
                                   ("ok", {"value": ""}, 422)):  # fmt: skip
            assert c.put(f"/v1/secrets/{name}", json=body).status_code == status
        assert c.delete("/v1/secrets/nope").status_code == 404
        assert b.delete("/v1/secrets/mine").status_code == 404
        assert c.delete("/v1/secrets/mine").status_code == 204


def test_ingress_reaches_a_sandbox_port_through_the_api_only(platform: Platform) -> None:
    with platform.client() as c, platform.client(platform.key_b) as b:
        sb = create(c)
        sid = sb["id"]
        serve = "cd /srv/www && (nohup python3 -m http.server 8000 >/dev/null 2>&1 &)"
        run(c, sid, f"mkdir -p /srv/www && echo hello-ingress > /srv/www/index.html && {serve}")
        deadline = time.monotonic() + 30
        while (r := c.get(f"/v1/sandboxes/{sid}/ports/8000/index.html")).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        assert r.status_code == 200 and r.text == "hello-ingress\n", r.text
        r = c.post(f"/v1/sandboxes/{sid}/ports/8000/nope", content=b"x" * 1000)
        assert r.status_code == 501  # http.server has no POST: its own answer comes back
        # Only through the API, only for the owner.
        assert httpx.get(f"{platform.api_url}/v1/sandboxes/{sid}/ports/8000/").status_code == 401
        assert b.get(f"/v1/sandboxes/{sid}/ports/8000/").status_code == 404
        r = c.get(f"/v1/sandboxes/{sid}/ports/8001/")
        assert r.status_code == 502 and "8001" in r.json()["detail"]
        assert c.get(f"/v1/sandboxes/{sid}/ports/0/").status_code == 422
        c.delete(f"/v1/sandboxes/{sid}")


# A service in the sandbox that streams: GET /N answers N bytes, POST answers the length and
# sha256 of what it read (Content-Length or chunked).
STREAMER = """
import hashlib, http.server
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        n = int(self.path.strip("/"))
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        chunk = b"x" * 65536
        while n > 0:
            self.wfile.write(chunk[: min(n, len(chunk))])
            n -= min(n, len(chunk))
    def do_POST(self):
        h, total = hashlib.sha256(), 0
        def take(data):
            nonlocal total
            h.update(data)
            total += len(data)
        if self.headers.get("Transfer-Encoding") == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                take(self.rfile.read(size))
                self.rfile.readline()
            self.rfile.readline()
        else:
            n = int(self.headers["Content-Length"])
            while n:
                data = self.rfile.read(min(n, 65536))
                take(data)
                n -= len(data)
        body = f"{total} {h.hexdigest()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8002), H).serve_forever()
"""


def test_ingress_streams_both_ways_without_holding_bodies(platform: Platform) -> None:
    """32 MiB up (with a length, and chunked without one) and 64 MiB down through the API:
    every byte arrives, and the API's peak memory grows by far less than a body."""
    with platform.client() as c:
        sid = create(c)["id"]
        r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/root/streamer.py"},
                  content=STREAMER.encode())  # fmt: skip
        assert r.status_code == 200, r.text
        run(c, sid, "(nohup python3 /root/streamer.py >/dev/null 2>&1 &)")
        deadline = time.monotonic() + 30
        while (r := c.get(f"/v1/sandboxes/{sid}/ports/8002/10")).status_code == 502:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.3)
        assert r.status_code == 200 and r.content == b"x" * 10, r.text
        before = peak_rss_mib(platform.api.pid)
        size = 32 << 20
        block = bytes(range(256)) * 4096  # 1 MiB
        digest = hashlib.sha256(block * 32).hexdigest()
        r = c.post(f"/v1/sandboxes/{sid}/ports/8002/sum", content=block * 32, timeout=300)
        assert r.status_code == 200 and r.text == f"{size} {digest}", r.text
        chunked = c.post(f"/v1/sandboxes/{sid}/ports/8002/sum", timeout=300,
                         content=(block for _ in range(32)))  # fmt: skip
        assert chunked.status_code == 200 and chunked.text == f"{size} {digest}", chunked.text
        got = 0
        with c.stream("GET", f"/v1/sandboxes/{sid}/ports/8002/{2 * size}", timeout=300) as down:
            assert down.status_code == 200
            for chunk in down.iter_bytes():
                got += len(chunk)
        assert got == 2 * size
        assert peak_rss_mib(platform.api.pid) - before < 24
        c.delete(f"/v1/sandboxes/{sid}")

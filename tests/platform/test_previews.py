"""Preview hosts and links, in real VMs: `{port}-{sandbox}.localhost` on the API's address is a
sandbox's port at an origin of its own; without the key it opens only by a link, for that port
of that sandbox, until the link expires or its key is revoked; the link's cookie never reaches
the sandbox; another tenant, a forged or altered link, a link moved to another host, and a
redirect off the site all fail; headless Chromium opens a link and the page's own requests go
through."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

import space

from ..stack import Platform
from .test_console import ARGS, CHROMIUM

pytestmark = pytest.mark.vm

# Echoes each request's path and headers as JSON; /page is a page that asks /echo by itself.
ECHO = r"""
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PAGE = (b"<html><body><p id=out>loading</p><script>fetch('/echo?from=page')"
        b".then(r => r.json()).then(j => { document.getElementById('out').textContent ="
        b" 'echo ' + j.path; })</script></body></html>")

class Echo(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/page":
            body, kind = PAGE, "text/html"
        else:
            seen = {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}
            body, kind = json.dumps(seen).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever()
"""


@pytest.fixture(scope="module")
def client(platform: Platform) -> Iterator[space.Space]:
    with space.Space(platform.api_url, platform.key_a) as c:
        yield c


@pytest.fixture(scope="module")
def echo(client: space.Space) -> Iterator[space.Sandbox]:
    with space.Sandbox.create(client=client) as sb:
        sb.files.write("/root/echo.py", ECHO)
        sb.processes.start(["python3", "/root/echo.py"], tag="echo")
        deadline = time.monotonic() + 120
        while True:
            try:
                if sb.request(8000, path="/").status_code == 200:
                    break
            except space.APIError as e:  # 502 until it listens
                assert e.status == 502 and time.monotonic() < deadline, e
            time.sleep(0.5)
        yield sb


def host_of(platform: Platform, sandbox_id: str, port: int = 8000) -> str:
    return f"{port}-{sandbox_id}.localhost:{urlsplit(platform.api_url).port}"


def at(platform: Platform, host: str, target: str, **headers: str) -> httpx.Response:
    """GET `target` (a path and query) with this Host, at the API's address."""
    return httpx.get(platform.api_url + target, headers={"Host": host, **headers}, timeout=60)


def raw_location(platform: Platform, host: str, target: str) -> str:
    """The Location of the answer to a request target sent as it is (httpx would encode it)."""
    with socket.create_connection(("127.0.0.1", urlsplit(platform.api_url).port), 30) as s:
        s.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    assert head[0].split()[1] == "303", head
    fields = dict(line.split(": ", 1) for line in head[1:])
    return {k.lower(): v for k, v in fields.items()}["location"]


def token_of(link: space.PreviewLink) -> str:
    query = urlsplit(link.url).query
    assert query.startswith("space_link="), link.url
    return query[len("space_link=") :]


def test_a_preview_host_wants_the_key_and_shows_only_the_service(
    platform: Platform, echo: space.Sandbox
) -> None:
    host = host_of(platform, echo.id)
    r = at(platform, host, "/hello?x=1")
    assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json"
    assert "link" in r.json()["detail"]
    assert at(platform, host, "/", Authorization=f"Bearer {platform.key_b}").status_code == 404

    r = at(platform, host, "/hello?x=1", Authorization=f"Bearer {platform.key_a}")
    assert r.status_code == 200 and "1.1 space" in r.headers["via"], r.text
    assert r.json()["path"] == "/hello?x=1"
    assert "authorization" not in r.json()["headers"]  # the key stays with the API
    # The API's own routes are not there: the path is the service's.
    r = at(platform, host, "/v1/sandboxes", Authorization=f"Bearer {platform.key_a}")
    assert r.status_code == 200 and r.json()["path"] == "/v1/sandboxes", r.text
    # Nothing listens on 8001: the API says so, at that host too.
    r = at(platform, host_of(platform, echo.id, 8001), "/",
           Authorization=f"Bearer {platform.key_a}")  # fmt: skip
    assert r.status_code == 502, r.text


def test_a_link_opens_one_port_of_one_sandbox_until_it_ends(
    platform: Platform, client: space.Space, echo: space.Sandbox
) -> None:
    link = echo.link(8000, expires_in_s=600)
    host = host_of(platform, echo.id)
    assert urlsplit(link.url).netloc == host and link.port == 8000
    token = token_of(link)

    # The token is traded for a cookie of this host only, then the page runs on the cookie.
    r = at(platform, host, f"/?space_link={token}")
    assert r.status_code == 303 and r.headers["location"] == "/", r.text
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"space_link={token};") and "HttpOnly" in cookie, cookie
    assert "samesite=lax" in cookie.lower() and "Domain" not in cookie, cookie
    r = at(platform, host, "/deep/er?q=2&space_link=" + token)
    assert r.status_code == 303 and r.headers["location"] == "/deep/er?q=2", r.text
    r = at(platform, host, "/deep/er?q=2", Cookie=f"theirs=1; space_link={token}")
    assert r.status_code == 200, r.text
    # The service's own cookies pass; ours does not.
    assert r.json()["headers"]["cookie"] == "theirs=1", r.json()
    # A path that would send the browser off the site stays on it.
    r = at(platform, host, f"//elsewhere.example/x?space_link={token}")
    assert r.status_code == 303 and r.headers["location"] == "/elsewhere.example/x"
    assert raw_location(platform, host, f"/\\elsewhere.example/?space_link={token}") == (
        "/elsewhere.example/"  # browsers read "/\\x" as "//x"
    )

    # Not another port, not another sandbox, not altered, not forged.
    with space.Sandbox.create(client=client) as other:
        for wrong in (host_of(platform, echo.id, 8001), host_of(platform, other.id)):
            assert at(platform, wrong, f"/?space_link={token}").status_code == 401
            assert at(platform, wrong, "/", Cookie=f"space_link={token}").status_code == 401
    altered = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
    forged = token.split(".")[0] + ".bm90IGEgc2VhbGVkIGxpbms"
    for bad in (altered, forged, "x", "." * 2000):
        assert at(platform, host, f"/?space_link={bad}").status_code == 401
        assert at(platform, host, "/", Cookie=f"space_link={bad}").status_code == 401

    # Another tenant cannot sign one for this sandbox; bad requests say what was wrong.
    with platform.client(platform.key_b) as b:
        assert b.post(f"/v1/sandboxes/{echo.id}/links", json={"port": 8000}).status_code == 404
    with platform.client() as a:
        for body in ({"port": 0}, {"port": 8000, "expires_in_s": 10**9}, {"port": "x"}, {}):
            r = a.post(f"/v1/sandboxes/{echo.id}/links", json=body)
            assert r.status_code == 422 and r.json()["errors"], (body, r.text)

    # It ends when it expires.
    short = token_of(echo.link(8000, expires_in_s=2))
    assert at(platform, host, "/", Cookie=f"space_link={short}").status_code == 200
    time.sleep(3.1)  # past its end, however the second it was made in had begun
    r = at(platform, host, "/", Cookie=f"space_link={short}")
    assert r.status_code == 401 and "expired" in r.json()["detail"], r.text


def test_revoking_the_key_ends_its_links(platform: Platform, echo: space.Sandbox) -> None:
    with platform.client() as a, platform.client(platform.admin_key) as admin:
        tenant = a.get("/v1/me").json()["tenant_id"]
        made = admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "links"}).json()
        with space.Space(platform.api_url, made["key"]) as c:
            token = token_of(space.Sandbox.get(echo.id, client=c).link(8000))
        host = host_of(platform, echo.id)
        assert at(platform, host, "/", Cookie=f"space_link={token}").status_code == 200
        assert admin.delete(f"/v1/tenants/{tenant}/keys/{made['id']}").status_code == 204
        r = at(platform, host, "/", Cookie=f"space_link={token}")
        assert r.status_code == 401 and "revoked" in r.json()["detail"], r.text


def test_a_browser_opens_a_link(platform: Platform, echo: space.Sandbox) -> None:
    """Chromium resolves every *.localhost name to this machine by itself."""
    link = echo.link(8000)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            page = browser.new_page()
            url = urlsplit(link.url)
            page.goto(f"{url.scheme}://{url.netloc}/page?{url.query}")
            assert urlsplit(page.url).path == "/page" and "space_link" not in page.url
            expect(page.locator("#out")).to_have_text("echo /echo?from=page", timeout=60_000)
        finally:
            browser.close()

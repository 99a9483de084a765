"""WebSockets to a sandbox's port, through the API: at the ingress route with the key and at a
preview host with a link's cookie. The service is a real WebSocket server in the guest (tornado,
from the code-interpreter template). Messages both ways (text, a 1 MiB binary one), the
subprotocols offered, the path, query and headers (never our credentials), the service's
refusal and its close code passed on; another tenant, no key and a link to another port refused."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from httpx_ws import WebSocketDisconnect, WebSocketUpgradeError, connect_ws

from ..stack import Platform
from .helpers import run

pytestmark = pytest.mark.vm

PORT = 8765
SERVER = f"""cat > /tmp/ws.py <<'PY'
import asyncio, json, pathlib
import tornado.web, tornado.websocket

class Echo(tornado.websocket.WebSocketHandler):
    def select_subprotocol(self, offered):
        return "chat" if "chat" in offered else None

    def open(self):
        self.write_message(json.dumps({{"uri": self.request.uri,
                                        "headers": dict(self.request.headers)}}))

    def on_message(self, message):
        if message == "close":
            self.close(4001, "asked to")
        else:
            self.write_message(message, binary=isinstance(message, bytes))

async def main():
    tornado.web.Application([(r"/echo", Echo)]).listen({PORT}, "127.0.0.1")
    pathlib.Path("/tmp/ws-up").touch()
    await asyncio.Event().wait()

asyncio.run(main())
PY
python3 /tmp/ws.py >/tmp/ws.log 2>&1 &
for i in $(seq 100); do test -e /tmp/ws-up && exit 0; sleep 0.1; done; cat /tmp/ws.log; exit 1"""


@pytest.fixture(scope="module")
def service(platform: Platform, code_interpreter: str) -> Iterator[str]:
    with platform.client() as c:
        # E2B's size of it: the session makes one base snapshot of the template, not two.
        r = c.post("/v1/sandboxes", json={"template": code_interpreter, "memory_mib": 512})
        assert r.status_code == 201 and r.json()["state"] == "running", r.text
        sandbox_id = r.json()["id"]
        try:
            out, err, code = run(c, sandbox_id, SERVER, timeout=60)
            assert code == 0, (out, err)
            yield sandbox_id
        finally:
            c.delete(f"/v1/sandboxes/{sandbox_id}")


def ws_url(platform: Platform, sandbox_id: str, path: str) -> str:
    return (
        f"{platform.api_url.replace('http', 'ws', 1)}/v1/sandboxes/{sandbox_id}/ports/{PORT}/{path}"
    )


def test_messages_both_ways_with_the_key(platform: Platform, service: str) -> None:
    headers = {"Authorization": f"Bearer {platform.key_a}", "X-Mine": "kept"}
    with httpx.Client(headers=headers) as http, connect_ws(
        ws_url(platform, service, "echo?x=1"), http, subprotocols=["other", "chat"]
    ) as ws:  # fmt: skip
        hello = json.loads(ws.receive_text())
        assert hello["uri"] == "/echo?x=1" and ws.subprotocol == "chat"
        seen = {k.lower() for k in hello["headers"]}
        assert "x-mine" in seen and "authorization" not in seen
        ws.send_text("hello")
        assert ws.receive_text() == "hello"
        blob = os.urandom(1 << 20)
        ws.send_bytes(blob)
        assert ws.receive_bytes() == blob
        ws.send_text("close")
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 4001 and closed.value.reason == "asked to"


def test_refusals(platform: Platform, service: str) -> None:
    def status(path: str, key: str | None, sandbox_id: str = service) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(headers=headers) as http:
            try:
                with connect_ws(ws_url(platform, sandbox_id, path), http):
                    return "open"
            except WebSocketUpgradeError as e:
                return e.response.status_code

    assert status("echo", platform.key_b) == 404  # another tenant's sandbox
    assert status("echo", None) == 401
    assert status("nope", platform.key_a) == 404  # the service's own refusal
    assert status("echo", platform.key_a, "sb-missing") == 404


def test_a_preview_host_by_a_link(platform: Platform, service: str) -> None:
    with platform.client() as c:
        link = c.post(f"/v1/sandboxes/{service}/links", json={"port": PORT}).json()["url"]
        other = c.post(f"/v1/sandboxes/{service}/links", json={"port": PORT + 1}).json()["url"]
    host = f"{PORT}-{service}.localhost"
    base = platform.api_url.replace("http", "ws", 1)

    def cookie(url: str) -> str:
        r = httpx.get(platform.api_url + "/" + url.split("/", 3)[3], headers={"Host": host})
        assert r.status_code == 303, r.text
        return r.headers["set-cookie"].split(";")[0]

    with httpx.Client(headers={"Host": host, "Cookie": cookie(link)}) as http, connect_ws(
        f"{base}/echo", http
    ) as ws:  # fmt: skip
        hello = json.loads(ws.receive_text())
        assert hello["uri"] == "/echo" and "space_link" not in hello["headers"].get("Cookie", "")
        ws.send_text("via a link")
        assert ws.receive_text() == "via a link"
    # A page of another preview host (the same site: the cookie would go along) is refused.
    elsewhere = f"http://1-sb-elsewhere.localhost:{platform.api_url.rsplit(':', 1)[1]}"
    with pytest.raises(WebSocketUpgradeError) as foreign, httpx.Client(
        headers={"Host": host, "Cookie": cookie(link), "Origin": elsewhere}
    ) as http, connect_ws(f"{base}/echo", http):  # fmt: skip
        pass
    assert foreign.value.response.status_code == 403
    # A link to another port of the sandbox does not open this one.
    theirs = f"space_link={other.split('space_link=')[1]}"
    with pytest.raises(WebSocketUpgradeError) as refused, httpx.Client(
        headers={"Host": host, "Cookie": theirs}
    ) as http, connect_ws(f"{base}/echo", http):  # fmt: skip
        pass
    assert refused.value.response.status_code == 401

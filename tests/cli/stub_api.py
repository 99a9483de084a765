"""A loopback stand-in for the API's listing calls, so the CLI's listings, its completion and
its start-up benchmark run without a platform. From the rows it is given, it answers what the
real API answers for GET /v1/sandboxes (paged by cursor), /v1/templates, /v1/volumes and GET of
one of them by id; it checks the bearer key and keeps the requests it saw."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

KEY = "sk_space_stubstubstub_0123456789abcdef"


def sandbox(n: int, **fields: Any) -> dict[str, Any]:
    """A sandbox as the API describes one; `fields` override."""
    return {
        "id": f"sb-{n:016x}",
        "state": "running",
        "desired_state": "running",
        "reason": None,
        "template": "base",
        "vcpus": 1,
        "memory_mib": 256,
        "disk_mib": 1024,
        "timeout_s": 300,
        "timeout_action": "pause",
        "expires_at": "2026-12-02T11:05:00Z",
        "env": {},
        "metadata": {"n": str(n)},
        "worker_id": "w1",
        "created_at": "2026-12-02T11:00:00.123456Z",
        "updated_at": "2026-12-02T11:00:01+00:00",
        "boot": "pool",
        "volumes": [],
        **fields,
    }


def template(name: str, size: int = 2, ready: int = 1) -> dict[str, Any]:
    pool = {"size": size, "vcpus": 1, "memory_mib": 256, "disk_mib": 1024, "ready": ready,
            "starting": size - ready}  # fmt: skip
    return {"id": name, "state": "ready", "error": None, "built": {"digest": "sha256:ab"},
            "created_at": "2026-12-01T09:00:00Z", "pool": pool}  # fmt: skip


def volume(n: int, name: str = "") -> dict[str, Any]:
    return {"id": f"vol-{n:08x}", "name": name, "size_mib": 1024, "state": "ready",
            "created_at": "2026-12-01T10:00:00Z"}  # fmt: skip


class StubAPI:
    """`with StubAPI(sandboxes=[...]) as api:` serves on `api.url` until the block ends."""

    def __init__(
        self,
        sandboxes: Sequence[Mapping[str, Any]] = (),
        templates: Sequence[Mapping[str, Any]] = (),
        volumes: Sequence[Mapping[str, Any]] = (),
        page_size: int | None = None,
    ) -> None:
        self.rows = {"sandboxes": list(sandboxes), "templates": list(templates),
                     "volumes": list(volumes)}  # fmt: skip
        self.page_size = page_size  # smaller than the client's limit: forces several pages
        self.requests: list[str] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                stub.requests.append(self.path)
                if self.headers.get("Authorization") != f"Bearer {KEY}":
                    self._answer(401, {"title": "Unauthorized", "status": 401,
                                       "detail": "bad key"})  # fmt: skip
                    return
                url = urlsplit(self.path)
                kind, _, item = url.path.removeprefix("/v1/").partition("/")
                found = [r for r in stub.rows.get(kind, ()) if item and r["id"] == item]
                if found:
                    self._answer(200, found[0])
                    return
                if kind not in stub.rows or item:
                    self._answer(404, {"title": "Not Found", "status": 404, "detail": url.path})
                    return
                if kind != "sandboxes":
                    self._answer(200, {"items": stub.rows[kind]})
                    return
                query = parse_qs(url.query)
                start = int(query.get("cursor", ["0"])[0])
                size = min(int(query.get("limit", ["100"])[0]), stub.page_size or 1 << 30)
                items = stub.rows[kind][start : start + size]
                more = start + size < len(stub.rows[kind])
                self._answer(200, {"items": items, "next_cursor": str(start + size) if more
                                   else None})  # fmt: skip

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                kind = "application/json" if status < 400 else "application/problem+json"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> StubAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def env(self) -> dict[str, str]:
        """Environment variables that point the CLI and SDK at this stub."""
        return {"SPACE_API_URL": self.url, "SPACE_API_KEY": KEY}

"""The control plane's audit log, through the real API: every change recorded with who, what,
when, from where and how it ended; each tenant reads only its own; exported as JSON lines."""

from __future__ import annotations

import json

import httpx

from ..cli.runner import space
from ..stack import Platform
from .helpers import run


def entries(c: httpx.Client, **params: str) -> list[dict[str, object]]:
    r = c.get("/v1/audit", params={"limit": "1000", **params})
    assert r.status_code == 200, r.text
    return list(r.json()["items"])


def test_every_change_is_recorded_with_who_what_and_how_it_ended(platform: Platform) -> None:
    with platform.client() as a, platform.client(platform.key_b) as b, \
            platform.client(platform.admin_key) as admin:  # fmt: skip
        me = a.get("/v1/me").json()
        made = a.post("/v1/sandboxes", json={"metadata": {"for": "audit"}})
        assert made.status_code in (200, 201), made.text
        sid = made.json()["id"]
        assert run(a, sid, "true")[2] == 0  # the data plane is not recorded
        assert a.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
        assert a.post(f"/v1/sandboxes/{sid}/resume").status_code == 200
        policy = {"network": {"hosts": [{"pattern": "example.com"}]}}
        assert a.put(f"/v1/sandboxes/{sid}/network", json=policy).status_code == 200
        assert b.delete(f"/v1/sandboxes/{sid}").status_code == 404  # B tries A's sandbox
        assert a.post(f"/v1/sandboxes/{sid}/fork", json={"count": 99}).status_code == 422
        key = admin.post(f"/v1/tenants/{me['tenant_id']}/keys", json={"name": "audited"})
        assert key.status_code == 201, key.text
        assert admin.delete(f"/v1/tenants/{me['tenant_id']}/keys/{key.json()['id']}").is_success
        with httpx.Client(base_url=platform.api_url) as anonymous:  # nobody: not recorded
            anonymous.post("/v1/sandboxes", json={}, headers={"Authorization": "Bearer sk_x_y"})
            anonymous.post("/v1/nothing/here", content=b"x" * 10_000)  # 404
            anonymous.delete("/v1/audit")  # 405
            anonymous.post("/e2b/sandboxes", json={})  # 401, by the E2B surface
        assert a.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"

        mine = entries(a, subject=sid)
        assert [e["action"] for e in mine] == [
            "POST /v1/sandboxes",
            "POST /v1/sandboxes/{sandbox_id}/pause",
            "POST /v1/sandboxes/{sandbox_id}/resume",
            "PUT /v1/sandboxes/{sandbox_id}/network",
            "POST /v1/sandboxes/{sandbox_id}/fork",
            "DELETE /v1/sandboxes/{sandbox_id}",
        ]
        first = mine[0]
        assert first["created"] == sid and first["outcome"] == "ok"
        assert first["request_id"] == made.headers["x-request-id"]
        assert (first["tenant_id"], first["key_id"]) == (me["tenant_id"], me["key_id"])
        assert first["remote"] == "127.0.0.1" and first["at"]
        assert [e["outcome"] for e in mine if "fork" in str(e["action"])] == ["refused"]
        assert not entries(a, action="/exec")
        # B's attempt is B's: A does not see it, B and an admin do.
        (tried,) = entries(b, subject=sid)
        assert (tried["action"], tried["status"], tried["outcome"]) == (
            "DELETE /v1/sandboxes/{sandbox_id}", 404, "refused")  # fmt: skip
        assert tried["tenant_id"] != me["tenant_id"]
        assert len(entries(admin, subject=sid)) == len(mine) + 1
        r = b.get("/v1/audit", params={"tenant": me["tenant_id"]})
        assert r.status_code == 403, r.text
        # The admin's key calls are the admin's, about A's tenant and the key made.
        keys = entries(admin, subject=key.json()["id"])
        assert [(e["action"], e["admin"]) for e in keys] == [
            ("POST /v1/tenants/{tenant_id}/keys", True),
            ("DELETE /v1/tenants/{tenant_id}/keys/{key_id}", True),
        ]
        assert key.json()["key"] not in json.dumps(entries(admin))
        assert not [e for e in entries(admin) if e["tenant_id"] is None and e["status"] >= 400]

        # Exported as JSON lines, through the API and the CLI: the same entries.
        with a.stream("GET", "/v1/audit", params={"subject": sid, "format": "jsonl",
                                                  "limit": "2"}) as r:  # fmt: skip
            assert r.headers["content-type"].startswith("application/jsonl")
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines == mine
        env = {"SPACE_API_URL": platform.api_url, "SPACE_API_KEY": platform.key_a}
        out = space("audit", "--subject", sid, "--jsonl", env=env).stdout
        assert [json.loads(line)["id"] for line in out.splitlines()] == [e["id"] for e in mine]
        table = space("audit", "--subject", sid, "--action", "/pause", env=env).stdout
        assert "POST /v1/sandboxes/{sandbox_id}/pause" in table and "200 ok" in table

        for bad in ({"limit": "0"}, {"since": "yesterday"}, {"format": "xml"}):
            r = a.get("/v1/audit", params=bad)
            assert r.status_code == 422 and "Traceback" not in r.text, (bad, r.text)


def test_the_e2b_surface_is_recorded_too(platform: Platform) -> None:
    with platform.client(platform.admin_key) as admin, httpx.Client(
        base_url=f"{platform.api_url}/e2b", headers={"X-API-Key": platform.key_a}, timeout=120
    ) as e2b:  # fmt: skip
        r = e2b.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert e2b.delete(f"/sandboxes/{sid}").status_code == 204
        recorded = entries(admin, subject=sid)
    assert [(e["action"], e["created"]) for e in recorded] == [
        ("POST /e2b/sandboxes", sid),
        ("DELETE /e2b/sandboxes/{sandbox_id}", None),
    ]

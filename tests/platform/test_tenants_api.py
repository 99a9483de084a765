"""Tenants and keys over the API: only admin keys reach it (403 for every other key, before any
input is looked at); a key made there works, is listed without its secret, and is refused once
revoked, the key revoking itself included, each step logged without the key; unknown ids are 404
and bad input 422."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.db.store import POOL_TENANT

from ..network.world import ORIGINS
from ..stack import Platform

pytestmark = pytest.mark.vm
POOL = Path("/var/lib/space/pool")


def problem(r: httpx.Response, status: int) -> str:
    """The detail of a problem+json answer of that status (and no trace in it)."""
    assert r.status_code == status, (status, r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    detail = r.json()["detail"]
    assert detail and "Traceback" not in r.text
    return str(detail)


def ids(platform: Platform) -> dict[str, Any]:
    with platform.client() as a:
        return dict(a.get("/v1/me").json())


def test_a_tenant_key_may_not_list_or_touch_anything(platform: Platform) -> None:
    me = ids(platform)
    tid, kid = me["tenant_id"], me["key_id"]
    routes: list[tuple[str, str, dict[str, Any]]] = [
        ("GET", "/v1/tenants", {}),
        ("POST", "/v1/tenants", {"json": {"name": f"x-{secrets.token_hex(4)}"}}),
        ("POST", "/v1/tenants", {"json": {"name": ""}}),  # refused before it is read
        ("GET", f"/v1/tenants/{tid}", {}),
        ("GET", f"/v1/tenants/{tid}/keys", {}),
        ("POST", f"/v1/tenants/{tid}/keys", {"json": {"admin": True}}),
        ("POST", f"/v1/tenants/{tid}/keys", {"content": b"not json"}),
        ("DELETE", f"/v1/tenants/{tid}/keys/{kid}", {}),
        ("GET", "/v1/tenants/tn-nothing/keys", {}),
        ("PATCH", f"/v1/tenants/{tid}", {"json": {"name": "mine"}}),
        ("GET", f"/v1/tenants/{tid}/deletion", {}),
        ("DELETE", f"/v1/tenants/{tid}", {"params": {"confirm": "x"}}),
    ]
    before = {}
    with platform.client(platform.admin_key) as admin:
        before = {t["id"]: t["keys"] for t in admin.get("/v1/tenants").json()["items"]}
    for key in (platform.key_a, platform.key_b):
        with platform.client(key) as c:
            for method, path, kw in routes:
                detail = problem(c.request(method, path, **kw), 403)
                assert "admin key" in detail, (method, path, detail)
    with platform.client(platform.admin_key) as admin:
        after = {t["id"]: t["keys"] for t in admin.get("/v1/tenants").json()["items"]}
    assert after == before  # nothing was made or revoked
    with platform.client() as a:
        assert a.get("/v1/me").status_code == 200  # its own key too is untouched
    with httpx.Client(base_url=platform.api_url) as anonymous:
        problem(anonymous.get("/v1/tenants"), 401)


def test_an_admin_makes_a_tenant_and_a_key_that_works_then_revokes_it(
    platform: Platform,
) -> None:
    name = f"made-{secrets.token_hex(4)}"
    with platform.client(platform.admin_key) as admin:
        r = admin.post("/v1/tenants", json={"name": name})
        assert r.status_code == 201, r.text
        tenant = r.json()
        assert tenant["name"] == name and tenant["id"].startswith("tn-")
        assert (tenant["sandboxes"], tenant["keys"]) == (0, 0)
        assert "already" in problem(admin.post("/v1/tenants", json={"name": name}), 409)
        listed = {t["id"]: t for t in admin.get("/v1/tenants").json()["items"]}
        assert listed[tenant["id"]] == tenant == admin.get(f"/v1/tenants/{tenant['id']}").json()
        assert POOL_TENANT not in listed
        me_a = ids(platform)
        assert listed[me_a["tenant_id"]]["keys"] >= 1  # the other tenants are there too

        r = admin.post(f"/v1/tenants/{tenant['id']}/keys", json={"name": "ci"})
        assert r.status_code == 201, r.text
        assert r.headers["cache-control"] == "no-store"
        made = r.json()
        key = made["key"]
        assert key.startswith(f"sk_space_{made['id']}_") and not made["admin"]
        # The secret's own alphabet holds "_": cut it after the id, never at its last "_".
        secret = key.removeprefix(f"sk_space_{made['id']}_")
        assert made["name"] == "ci"

        # It works, as that tenant's key, and as nothing more.
        with platform.client(key) as new:
            me = new.get("/v1/me").json()
            assert me == {"tenant_id": tenant["id"], "tenant_name": name, "admin": False,
                          "key_id": made["id"]}  # fmt: skip
            assert new.get("/v1/sandboxes").json()["items"] == []
            problem(new.get("/v1/tenants"), 403)

        # Listed without its secret, or its hash.
        r = admin.get(f"/v1/tenants/{tenant['id']}/keys")
        assert r.json()["items"] == [{k: made[k] for k in ("id", "name", "admin", "created_at")}]
        assert secret not in r.text and "sha256" not in r.text
        listed = {t["id"]: t for t in admin.get("/v1/tenants").json()["items"]}
        assert listed[tenant["id"]]["keys"] == 1

        # Revoked: refused at once, gone from the list, and not revoked twice.
        path = f"/v1/tenants/{tenant['id']}/keys/{made['id']}"
        assert admin.delete(path).status_code == 204
        with platform.client(key) as new:
            assert "revoked" in problem(new.get("/v1/me"), 401)
        assert admin.get(f"/v1/tenants/{tenant['id']}/keys").json()["items"] == []
        problem(admin.delete(path), 404)

        # Each step logged with the key that took it; the key itself never.
        by = admin.get("/v1/me").json()["key_id"]
        api_log = (platform.tmp / "api.log").read_text()
        for line in (f"tenant {tenant['id']} ({name}) created by key {by}",
                     f"key {made['id']} (admin=False) of tenant {tenant['id']} created by key {by}",
                     f"key {made['id']} of tenant {tenant['id']} revoked by key {by}"):  # fmt: skip
            assert line in api_log
        assert secret not in api_log


def test_a_key_of_another_tenant_is_not_revoked_through_this_one(platform: Platform) -> None:
    me_a = ids(platform)
    with platform.client(platform.admin_key) as admin:
        other = admin.post("/v1/tenants", json={"name": f"o-{secrets.token_hex(4)}"}).json()
        problem(admin.delete(f"/v1/tenants/{other['id']}/keys/{me_a['key_id']}"), 404)
    with platform.client() as a:
        assert a.get("/v1/me").status_code == 200


def test_an_admin_key_may_revoke_itself_and_its_next_call_is_refused(
    platform: Platform,
) -> None:
    with platform.client(platform.admin_key) as admin:
        ops = admin.get("/v1/me").json()
        r = admin.post(f"/v1/tenants/{ops['tenant_id']}/keys", json={"admin": True})
        made = r.json()
        assert r.status_code == 201 and made["admin"] and made["name"] == ""
    with platform.client(made["key"]) as second:
        assert second.get("/v1/tenants").status_code == 200  # an operator's key
        r = second.delete(f"/v1/tenants/{ops['tenant_id']}/keys/{made['id']}")
        assert r.status_code == 204, r.text
        problem(second.get("/v1/tenants"), 401)
    with platform.client(platform.admin_key) as admin:
        assert admin.get("/v1/tenants").status_code == 200  # the first admin key still works


def test_unknown_ids_are_404_and_bad_input_422(platform: Platform) -> None:
    with platform.client(platform.admin_key) as admin:
        tid = admin.get("/v1/me").json()["tenant_id"]
        for method, path, kw in [
            ("GET", "/v1/tenants/tn-0000000000000000", {}),
            ("GET", "/v1/tenants/tn-0000000000000000/keys", {}),
            ("POST", "/v1/tenants/tn-0000000000000000/keys", {"json": {}}),
            ("DELETE", "/v1/tenants/tn-0000000000000000/keys/000000000000", {}),
            ("DELETE", f"/v1/tenants/{tid}/keys/000000000000", {}),
            ("GET", f"/v1/tenants/{POOL_TENANT}/keys", {}),  # the warm pools' has no keys
            ("POST", f"/v1/tenants/{POOL_TENANT}/keys", {"json": {}}),
        ]:
            assert "no " in problem(admin.request(method, path, **kw), 404), (method, path)
        for body in [{}, {"name": ""}, {"name": " padded"}, {"name": "a" * 101},
                     {"name": "(warm pool)"}, {"name": "line\nbreak"}, {"name": 7},
                     {"name": ["x"]}]:  # fmt: skip
            problem(admin.post("/v1/tenants", json=body), 422)
        problem(
            admin.post("/v1/tenants", content=b"{", headers={"content-type": "application/json"}),
            422,
        )
        for body in [{"name": "x" * 101}, {"name": "tab\there"}, {"admin": "maybe"},
                     {"name": None}]:  # fmt: skip
            problem(admin.post(f"/v1/tenants/{tid}/keys", json=body), 422)
        assert admin.get(f"/v1/tenants/{tid}/keys").status_code == 200


def test_an_admin_renames_a_tenant_then_deletes_it_and_all_it_holds(platform: Platform) -> None:
    """Deleting a tenant is stated before (what it deletes) and confirmed by its name; then its
    keys are refused at once, its sandboxes and volumes are deleted by the controller within a
    minute, its secrets and webhooks are gone, and its name can be taken again."""
    name = f"doomed-{secrets.token_hex(4)}"
    with platform.client(platform.admin_key) as admin:
        tid = admin.post("/v1/tenants", json={"name": name}).json()["id"]
        key = admin.post(f"/v1/tenants/{tid}/keys", json={}).json()["key"]
        with platform.client(key) as t:
            sb = t.post("/v1/sandboxes", json={})
            assert sb.status_code == 201, sb.text
            vol = t.post("/v1/volumes", json={"name": "data", "size_mib": 16}).json()["id"]
            assert t.put("/v1/secrets/token", json={"value": "s3cret"}).status_code == 200
            # An origin of the test world's internet: what is sent stays on this machine.
            url = f"http://{ORIGINS['allowed.test']}:8080/ok"
            hook = t.post("/v1/webhooks", json={"url": url})
            assert hook.status_code == 201, hook.text
        sid = sb.json()["id"]

        renamed = f"{name}-renamed"
        r = admin.patch(f"/v1/tenants/{tid}", json={"name": renamed})
        assert r.status_code == 200 and r.json()["name"] == renamed, r.text
        taken = admin.get("/v1/me").json()["tenant_name"]
        assert "already" in problem(admin.patch(f"/v1/tenants/{tid}", json={"name": taken}), 409)
        problem(admin.patch(f"/v1/tenants/{tid}", json={"name": "no spaces"}), 422)
        with platform.client(key) as t:
            assert t.get("/v1/me").json()["tenant_name"] == renamed  # its key still works

        stated = admin.get(f"/v1/tenants/{tid}/deletion").json()
        assert stated["sandboxes"] == [sid] and stated["volumes"] == [vol]
        assert (stated["keys"], stated["secrets"], stated["webhooks"]) == (1, 1, 1)
        detail = problem(admin.delete(f"/v1/tenants/{tid}"), 400)
        assert "1 sandbox(es)" in detail and f"confirm={renamed}" in detail
        problem(admin.delete(f"/v1/tenants/{tid}", params={"confirm": name}), 400)
        own = admin.get("/v1/me").json()["tenant_id"]
        problem(admin.delete(f"/v1/tenants/{own}", params={"confirm": taken}), 409)
        with platform.client(key) as t:
            assert t.get("/v1/sandboxes").status_code == 200  # nothing happened yet

        done = admin.delete(f"/v1/tenants/{tid}", params={"confirm": renamed})
        assert done.status_code == 200, done.text
        assert done.json()["sandboxes"] == [sid]
        with platform.client(key) as t:
            assert t.get("/v1/sandboxes").status_code == 401
        problem(admin.get(f"/v1/tenants/{tid}"), 404)
        assert tid not in {x["id"] for x in admin.get("/v1/tenants").json()["items"]}
        problem(admin.delete(f"/v1/tenants/{tid}", params={"confirm": renamed}), 404)

        rows = {r["id"]: r for r in platform.rows([sid])}
        deadline = time.monotonic() + 60
        while rows[sid]["state"] != "deleted":
            assert time.monotonic() < deadline, rows[sid]
            time.sleep(0.5)
            rows = {r["id"]: r for r in platform.rows([sid])}
        assert not list((POOL / "workers").glob(f"*/vms/{sid}"))  # its VM and disk are gone
        again = admin.post("/v1/tenants", json={"name": renamed})
        assert again.status_code == 201 and again.json()["id"] != tid
        # Its volume follows its sandbox; secrets and webhooks went with the tenant.
        state = "SELECT state FROM volumes WHERE id = :id"
        while platform.scalar(state, id=vol) != "deleted":
            assert time.monotonic() < deadline + 60, platform.scalar(state, id=vol)
            time.sleep(0.5)
        for table in ("secrets", "webhooks"):
            held = platform.scalar(f"SELECT count(*) FROM {table} WHERE tenant_id = :t", t=tid)
            assert held == 0, table

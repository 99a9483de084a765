"""Tenants cannot see or touch each other's sandboxes; bad input gets a clear 4xx, never a 500."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from .conftest import Platform
from .helpers import create

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def sandbox_of_a(platform: Platform) -> str:
    with platform.client() as c:
        return str(create(c, metadata={"owner": "a"})["id"])


def test_tenant_b_cannot_read_exec_or_delete_tenant_a_sandboxes(
    platform: Platform, sandbox_of_a: str
) -> None:
    with platform.client(platform.key_b) as b:
        sid = sandbox_of_a
        for method, path, kw in [
            ("GET", f"/v1/sandboxes/{sid}", {}),
            ("DELETE", f"/v1/sandboxes/{sid}", {}),
            ("POST", f"/v1/sandboxes/{sid}/pause", {}),
            ("POST", f"/v1/sandboxes/{sid}/exec", {"json": {"cmd": "id"}}),
            ("GET", f"/v1/sandboxes/{sid}/files", {"params": {"path": "/etc/hostname"}}),
            ("PUT", f"/v1/sandboxes/{sid}/files", {"params": {"path": "/x"}, "content": b"x"}),
            ("GET", f"/v1/sandboxes/{sid}/events", {}),
        ]:
            r = b.request(method, path, **kw)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert sid not in {s["id"] for s in b.get("/v1/sandboxes").json()["items"]}
    with platform.client() as a:
        assert a.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer nope"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer sk_space_000000000000_" + "A" * 43},
    ],
)
def test_requests_without_a_valid_key_are_401(platform: Platform, headers: dict[str, str]) -> None:
    r = httpx.get(f"{platform.api_url}/v1/sandboxes", headers=headers)
    assert r.status_code == 401
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["detail"]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"vcpus": 0}, "vcpus"),
        ({"memory_mib": "lots"}, "memory_mib"),
        ({"timeout_action": "explode"}, "timeout_action"),
        ({"env": {"1BAD": "x"}}, "not a valid variable name"),
        ({"id": "../../etc"}, "id"),
        ({"template": "nope"}, "no template"),
        ({"surprise": True}, "surprise"),
    ],
)
def test_bad_create_bodies_say_what_was_wrong(
    platform: Platform, body: dict[str, object], fragment: str
) -> None:
    with platform.client() as c:
        r = c.post("/v1/sandboxes", json=body)
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert fragment in r.text


def test_malformed_requests_are_4xx(platform: Platform, sandbox_of_a: str) -> None:
    sid = sandbox_of_a
    with platform.client() as c:
        cases = [
            c.post(
                "/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"}
            ),
            c.post(f"/v1/sandboxes/{sid}/exec", json={}),
            c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "x", "argv": ["y"]}),
            c.post(f"/v1/sandboxes/{sid}/exec", json={"argv": []}),
            c.post(f"/v1/sandboxes/{sid}/exec", json={"cmd": "a\u0000b"}),
            c.get(f"/v1/sandboxes/{sid}/files", params={"path": "relative"}),
            c.get(f"/v1/sandboxes/{sid}/files"),
            c.get("/v1/sandboxes", params={"limit": 100000}),
            c.get("/v1/sandboxes", params={"cursor": "garbage!"}),
            c.put(f"/v1/sandboxes/{sid}/timeout", json={"timeout_s": -1}),
            c.get("/v1/sandboxes/" + "x" * 5000),
        ]
        for r in cases:
            assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text)
            assert r.headers["content-type"] == "application/problem+json", r.request.url


def test_operator_makes_and_revokes_keys(platform: Platform) -> None:
    def admin(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "space.cli.main", "admin", *args],
            env=platform.env, capture_output=True, text=True, timeout=60, check=True,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        return r.stdout.strip()

    key = admin("create-key", "tenant-made-by-operator")
    assert key.startswith("sk_space_")
    assert httpx.get(f"{platform.api_url}/v1/sandboxes",
                     headers={"Authorization": f"Bearer {key}"}).status_code == 200  # fmt: skip
    admin("revoke-key", key[len("sk_space_") :].split("_")[0])
    assert httpx.get(f"{platform.api_url}/v1/sandboxes",
                     headers={"Authorization": f"Bearer {key}"}).status_code == 401  # fmt: skip

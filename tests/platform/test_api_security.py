"""Tenants cannot see or touch each other's sandboxes; bad input gets a clear 4xx, never a 500."""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from ..stack import Platform, Service, free_port
from .helpers import create, key_with_quotas, peak_rss_mib

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


@pytest.mark.parametrize(
    ("network", "said"),
    [
        ({"cidrs": [{"cidr": "169.254.169.254/32"}]}, "cloud metadata"),
        ({"cidrs": [{"cidr": "127.0.0.0/8", "ports": [5432]}]}, "never reachable"),
        ({"cidrs": [{"cidr": "10.0.0.0/8"}]}, "not opened by the operator"),
        ({"cidrs": [{"cidr": "10.128.0.0/16"}]}, "never reachable"),  # other sandboxes' links
        ({"allow_networks": ["169.254.0.0/16"]}, "cloud metadata"),
        ({"allow_networks": ["192.168.0.0/16"]}, "not opened by the operator"),
        ({"hosts": [{"pattern": "db.internal", "allow_private": True}]}, "no private network"),
    ],
)
def test_a_policy_cannot_open_the_host_the_cloud_or_private_networks(
    platform: Platform, sandbox_of_a: str, network: dict[str, object], said: str
) -> None:
    """At creation and on change, from a tenant's own key: 422, and the policy stays as it was."""
    with platform.client() as a:
        before = a.get(f"/v1/sandboxes/{sandbox_of_a}").json()["network"]
        r = a.put(f"/v1/sandboxes/{sandbox_of_a}/network", json={"network": network})
        assert r.status_code == 422 and said in r.text, r.text
        assert a.get(f"/v1/sandboxes/{sandbox_of_a}").json()["network"] == before
        r = a.post("/v1/sandboxes", json={"template": "base", "network": network})
        assert r.status_code == 422 and said in r.text, r.text


def _send_then_read(address: tuple[str, int], head: bytes, chunks: Iterator[bytes]) -> bytes:
    """Send a head and as much of a body as the API takes; what it answered (it may answer and
    close before the body is done)."""
    with socket.create_connection(address, timeout=10) as s:
        s.sendall(head)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for chunk in chunks:
                s.sendall(chunk)
        reply = b""
        with contextlib.suppress(ConnectionResetError):
            while b"\r\n\r\n" not in reply and (data := s.recv(65536)):
                reply += data
            head, _, body = reply.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            while length and len(body) < int(length[1]) and (data := s.recv(65536)):
                body += data
        return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("authenticated", [False, True])
def test_an_oversized_body_is_refused_before_it_is_read(
    platform: Platform, authenticated: bool
) -> None:
    """256 MiB declared, or 64 MiB sent chunked with no length: 413 from the first MiB on, with
    or without a key, and the API's peak memory does not grow by the body."""
    url = httpx.URL(platform.api_url)
    address = (url.host, url.port or 80)
    key = f"Authorization: Bearer {platform.key_a}\r\n" if authenticated else ""
    pid = platform.api.pid
    before = peak_rss_mib(pid)
    head = (f"POST /v1/sandboxes HTTP/1.1\r\nHost: api\r\n{key}Content-Type: application/json\r\n"
            f"Content-Length: {256 << 20}\r\n\r\n").encode()  # fmt: skip
    reply = _send_then_read(address, head, (b" " * (1 << 20) for _ in range(256)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"at most 1048576 bytes" in reply
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
    head = (f"POST /v1/sandboxes HTTP/1.1\r\nHost: api\r\n{key}Content-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()  # fmt: skip
    reply = _send_then_read(address, head, (chunk for _ in range(64)))
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert peak_rss_mib(pid) - before < 32
    with platform.client() as c:  # and the API serves on
        assert c.get("/v1/sandboxes").status_code == 200


def test_ids_chosen_by_one_tenant_tell_another_nothing(platform: Platform) -> None:
    """Creating with an id another tenant chose (or with the id it got) neither fails nor
    reaches that tenant's sandbox: each tenant's chosen ids live in a space of their own."""
    chosen = f"shared-{secrets.token_hex(3)}"
    with platform.client() as a, platform.client(platform.key_b) as b:
        mine = create(a, id=chosen)["id"]
        theirs = b.post("/v1/sandboxes", json={"id": chosen})
        assert theirs.status_code == 201, theirs.text
        assert theirs.json()["id"] != mine
        again = b.post("/v1/sandboxes", json={"id": mine})  # A's full id, chosen by B
        assert again.status_code == 201 and again.json()["id"] not in (mine, theirs.json()["id"])
        assert b.get(f"/v1/sandboxes/{mine}").status_code == 404
        for c, sid in ((a, mine), (b, theirs.json()["id"]), (b, again.json()["id"])):
            c.delete(f"/v1/sandboxes/{sid}", params={"wait": "false"})


@pytest.fixture(scope="module")
def tight_key(platform: Platform) -> str:
    """A tenant allowed 2 sandboxes of at most 2 vCPUs in all, and one 64 MiB volume."""

    return key_with_quotas(
        platform.database_url, "tight", {"sandboxes": 2, "vcpus": 2, "volumes": 1, "volume_mib": 64}
    )


def test_quotas_hold_under_concurrent_creates(platform: Platform, tight_key: str) -> None:
    with platform.client(tight_key) as c:
        big = c.post("/v1/sandboxes", json={"vcpus": 4})
        assert big.status_code == 429 and "vCPUs" in big.text, big.text

        def one(_: int) -> httpx.Response:
            with platform.client(tight_key) as own:
                return own.post("/v1/sandboxes", json={}, params={"wait": "false"})

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(one, range(6)))
        made = [r.json()["id"] for r in answers if r.status_code in (201, 202)]
        refused = [r for r in answers if r.status_code == 429]
        assert len(made) == 2 and len(refused) == 4, [(r.status_code, r.text) for r in answers]
        assert all("sandboxes" in r.json()["detail"] for r in refused)
        report = c.get("/v1/quotas").json()
        assert report["used"]["sandboxes"] == 2 and report["quotas"]["sandboxes"] == 2

        assert c.post("/v1/volumes", json={"name": "v1", "size_mib": 64}).status_code == 201
        second = c.post("/v1/volumes", json={"name": "v2", "size_mib": 16})
        assert second.status_code == 429 and "volumes" in second.text, second.text
        for sid in made:
            assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"
        # What was deleted counts no more.
        again = c.post("/v1/sandboxes", json={}, params={"wait": "false"})
        assert again.status_code in (201, 202), again.text
        # Gone again, so no later test finds it on a worker (the pool tests count them all).
        assert c.delete(f"/v1/sandboxes/{again.json()['id']}").json()["state"] == "deleted"


def test_a_tenant_past_its_rate_is_told_when_to_come_back(platform: Platform) -> None:
    """An API process limited to 2 requests a second in bursts of 5: the sixth of a burst is
    429 with Retry-After, for that tenant only."""
    port = free_port()
    limited = Service("api-limited", ["api", "--port", str(port)],
                      {**platform.env, "SPACE_RATE_LIMIT": "2", "SPACE_RATE_BURST": "5"},
                      platform.tmp / "api-limited.log")  # fmt: skip
    limited.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {platform.key_a}"})
        b = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {platform.key_b}"})
        with a, b:
            codes = [a.get("/v1/sandboxes").status_code for _ in range(8)]
            assert codes[:5] == [200] * 5 and 429 in codes[5:], codes
            refused = a.get("/v1/sandboxes")
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
            assert b.get("/v1/sandboxes").status_code == 200  # another tenant's own bucket
            time.sleep(1.2)
            assert a.get("/v1/sandboxes").status_code == 200  # and it refills
    finally:
        limited.stop()

"""Lifecycle webhooks through the real platform: registered over the API (each forbidden range
refused), every change of a real sandbox delivered signed to a receiver in a namespace of its
own, each delivery shown with its attempts, and nobody else's to see."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import space

from ..stack import Platform
from ..webhooks.receiver import Receiver, receiving
from .helpers import create

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Receiver]:
    with receiving(tmp_path_factory.mktemp("receiver")) as r:
        yield r


def of_sandbox(receiver: Receiver, sandbox_id: str) -> list[dict[str, Any]]:
    return [
        r for r in receiver.requests("/ok") if json.loads(r["body"])["sandbox_id"] == sandbox_id
    ]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://127.0.0.1:8080/", "loopback"),
        ("http://[::1]/", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://0.0.0.0/", "reserved"),
        ("http://10.0.0.1/", "private"),
        ("http://192.168.1.1/", "private"),
        ("http://100.64.0.1/", "private"),
        ("http://[fd00::1]/", "private"),
        ("http://10.128.0.2/", "never dialled"),  # a sandbox's own link
        ("http://[::ffff:169.254.169.254]/", "link-local"),  # IPv4-mapped
        ("http://[::a9fe:a9fe]/", "never dialled"),  # IPv4-compatible
        ("http://[2002:a9fe:a9fe::1]/", "never dialled"),  # 6to4 of the metadata address
        ("http://[::1/", "not a URL"),
        ("ftp://203.0.113.2/", "http"),
        ("http://user:pw@203.0.113.2/", "no user"),
        ("http://203.0.113.2:99999/", "port"),
        ("http:///nohost", "names a host"),
    ],
)
def test_a_webhook_may_not_point_where_nothing_may_dial(
    platform: Platform, url: str, said: str
) -> None:
    with platform.client() as c:
        r = c.post("/v1/webhooks", json={"url": url})
        assert r.status_code == 422 and said in r.json()["detail"], r.text
        assert url not in json.dumps(c.get("/v1/webhooks").json())


def test_bad_webhook_requests_are_refused_clearly(platform: Platform) -> None:
    with platform.client() as c:
        for body in ({}, {"url": "http://203.0.113.2/", "events": ["sandbox.exploded"]},
                     {"url": "http://203.0.113.2/", "events": []},
                     {"url": "http://203.0.113.2/", "surprise": 1},
                     {"url": "http://203.0.113.2/" + "a" * 3000}):  # fmt: skip
            r = c.post("/v1/webhooks", json=body)
            assert r.status_code == 422 and "Traceback" not in r.text, (body, r.text)
        assert c.get("/v1/webhooks/wh-nothing").status_code == 404
        assert c.delete("/v1/webhooks/wh-nothing").status_code == 404
        assert c.get("/v1/webhooks/wh-nothing/deliveries").status_code == 404
    with httpx.Client(base_url=platform.api_url) as anonymous:
        assert (
            anonymous.post("/v1/webhooks", json={"url": "http://203.0.113.2/"}).status_code == 401
        )


def test_a_sandboxs_life_is_delivered_signed_to_its_tenants_endpoint(
    platform: Platform, receiver: Receiver
) -> None:
    with platform.client() as a, platform.client(platform.key_b) as b:
        r = a.post("/v1/webhooks", json={"url": f"{receiver.url}/ok", "description": "ci"})
        assert r.status_code == 201, r.text
        hook = r.json()
        secret = hook.pop("secret")
        assert secret.startswith("whsec_") and r.headers["cache-control"] == "no-store"
        assert a.get(f"/v1/webhooks/{hook['id']}").json() == hook  # the secret: shown once
        # Another tenant neither sees nor touches it, nor is sent A's events.
        assert b.get(f"/v1/webhooks/{hook['id']}").status_code == 404
        assert b.delete(f"/v1/webhooks/{hook['id']}").status_code == 404
        assert b.get(f"/v1/webhooks/{hook['id']}/deliveries").status_code == 404
        assert hook["id"] not in json.dumps(b.get("/v1/webhooks").json())
        theirs = create(b)["id"]

        sid = create(a)["id"]
        assert a.post(f"/v1/sandboxes/{sid}/pause").json()["state"] == "paused"
        assert a.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        assert a.put(f"/v1/sandboxes/{sid}/timeout", json={"timeout_s": 1}).status_code == 200
        deadline = time.monotonic() + 60
        while a.get(f"/v1/sandboxes/{sid}").json()["state"] != "paused":  # its timeout's pause
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert a.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"
        b.delete(f"/v1/sandboxes/{theirs}")

        wanted = ["sandbox.created", "sandbox.running", "sandbox.paused", "sandbox.resumed",
                  "sandbox.timed_out", "sandbox.paused", "sandbox.deleted"]  # fmt: skip
        deadline = time.monotonic() + 30
        while len(mine := of_sandbox(receiver, sid)) < len(wanted):
            assert time.monotonic() < deadline, [m["headers"]["Space-Event"] for m in mine]
            time.sleep(0.2)
        assert [m["headers"]["Space-Event"] for m in mine] == wanted
        for m in mine:
            space.verify_webhook(secret, m["headers"]["Space-Signature"], m["body"])
            assert m["headers"]["Space-Webhook-Id"] == hook["id"]
        ours = [r for r in receiver.requests() if r["headers"]["Space-Webhook-Id"] == hook["id"]]
        assert not [r for r in ours if theirs in r["body"].decode()]

        shown = a.get(f"/v1/webhooks/{hook['id']}/deliveries").json()["items"]
        ours = [d for d in shown if d["payload"]["sandbox_id"] == sid]
        assert [d["type"] for d in reversed(ours)] == wanted  # newest first
        assert all(d["state"] == "delivered" and [t["status"] for t in d["attempts"]] == [200]
                   for d in ours)  # fmt: skip
        assert a.delete(f"/v1/webhooks/{hook['id']}").status_code == 204
        assert a.get(f"/v1/webhooks/{hook['id']}").status_code == 404

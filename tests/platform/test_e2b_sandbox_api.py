"""E2B's calls on a sandbox beyond commands and files, through the unmodified `e2b` SDK in real
sandboxes: forks that start from their parent's state and go their own way, an egress policy
changed on a running sandbox and tried from inside it, CPU and memory measured on the host,
snapshots that start sandboxes as they were, file URLs signed by the SDK. And what must not
work: another tenant's sandbox or snapshot, an altered or expired link, bad input."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from e2b import CommandExitException, Sandbox
from e2b.exceptions import SandboxException

from ..stack import Platform
from .helpers import fetch, key_with_quotas
from .test_e2b import opts

pytestmark = pytest.mark.vm

MiB = 1 << 20


def e2b_call(platform: Platform, method: str, path: str, key: str, **kw: object) -> httpx.Response:
    return httpx.request(method, f"{platform.api_url}/e2b{path}", headers={"X-API-Key": key},
                         timeout=60, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_fork_children_start_from_the_parents_state(platform: Platform) -> None:
    parent = Sandbox.create(timeout=600, **opts(platform))
    children: list[Sandbox] = []
    try:
        parent.commands.run("echo before > /root/state")
        parent_end = parent.get_info().end_at
        forked = parent.fork(count=2, timeout=120)
        assert all(isinstance(c, Sandbox) for c in forked), forked
        children = [c for c in forked if isinstance(c, Sandbox)]
        ids = {c.sandbox_id for c in children}
        assert len(ids) == 2 and parent.sandbox_id not in ids
        for child in children:
            assert child.commands.run("cat /root/state").stdout == "before\n"
            child.commands.run(f"echo {child.sandbox_id} > /root/own")
            left = child.get_info().end_at - datetime.now(UTC)
            assert timedelta(seconds=60) < left <= timedelta(seconds=121), left
        # Each went its own way: neither the parent nor the sibling sees what a child wrote.
        with pytest.raises(CommandExitException):
            parent.commands.run("test -e /root/own")
        first, second = children
        assert second.commands.run("cat /root/own").stdout == f"{second.sandbox_id}\n"
        assert first.commands.run("cat /root/own").stdout == f"{first.sandbox_id}\n"
        assert parent.is_running() and parent.get_info().end_at == parent_end
        # Another tenant cannot fork it; what the count may be is checked.
        r = e2b_call(platform, "POST", f"/sandboxes/{parent.sandbox_id}/fork", platform.key_b,
                     json={"count": 1})  # fmt: skip
        assert r.status_code == 404 and r.json()["code"] == 404, r.text
        for count in (0, 17, "two"):
            r = e2b_call(platform, "POST", f"/sandboxes/{parent.sandbox_id}/fork", platform.key_a,
                         json={"count": count})  # fmt: skip
            assert r.status_code in (400, 422) and r.json()["message"], r.text
    finally:
        for sandbox in (*children, parent):
            sandbox.kill()


def test_update_network_changes_egress_from_inside(platform: Platform) -> None:
    sbx = Sandbox.create(timeout=600, **opts(platform))
    try:
        with platform.client() as c:
            sid = sbx.sandbox_id
            assert fetch(c, sid, "http://allowed.test/")[0] == 3  # SPACE's default: deny
            sbx.update_network({"allow_out": ["allowed.test"]})
            code, out = fetch(c, sid, "http://allowed.test/")
            assert code == 0, out
            assert fetch(c, sid, "http://other.test/")[0] == 3
            # An update replaces the whole policy: what it leaves out is cleared.
            sbx.update_network({})
            assert fetch(c, sid, "http://allowed.test/")[0] == 3
            sbx.update_network({"allow_out": ["0.0.0.0/0"]})
            assert fetch(c, sid, "http://other.test/")[0] == 0
        for body in ({"denyOut": ["10.0.0.0/8"]}, {"rules": {"x.test": []}},
                     {"dnsServers": ["9.9.9.9"]}, {"allowOut": ["not a host!"]}):  # fmt: skip
            r = e2b_call(platform, "PUT", f"/sandboxes/{sid}/network", platform.key_a, json=body)
            assert r.status_code == 400 and r.json()["code"] == 400, r.text
        with pytest.raises(SandboxException, match="denyOut"):
            sbx.update_network({"deny_out": ["10.0.0.0/8"]})
        r = e2b_call(platform, "PUT", f"/sandboxes/{sid}/network", platform.key_b,
                     json={"allowOut": ["allowed.test"]})  # fmt: skip
        assert r.status_code == 404, r.text
        with platform.client() as c:
            assert fetch(c, sid, "http://other.test/")[0] == 0  # the refused ones changed nothing
    finally:
        sbx.kill()


def test_metrics_are_measured_on_the_host(platform: Platform) -> None:
    sbx = Sandbox.create(timeout=600, **opts(platform))
    try:
        info = sbx.get_info()
        spin = sbx.commands.run("timeout 20 sh -c 'while :; do :; done'", background=True)
        time.sleep(1)
        busy = sbx.get_metrics()
        assert len(busy) == 1, busy
        point = busy[0]
        assert point.cpu_count == info.cpu_count
        assert point.mem_total == info.memory_mb * MiB
        assert 16 * MiB < point.mem_used <= point.mem_total
        with platform.client() as c:
            disk_mib = c.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()["disk_mib"]
        assert point.disk_total == disk_mib * MiB and 0 < point.disk_used <= point.disk_total
        assert abs(point.timestamp - datetime.now(UTC)) < timedelta(seconds=30)
        spin.kill()
        time.sleep(2)
        idle = sbx.get_metrics()[0]
        # A guest spinning keeps its vCPU busy; the same guest idle leaves it mostly idle.
        assert point.cpu_used_pct > 50 and idle.cpu_used_pct < point.cpu_used_pct / 2, (
            point.cpu_used_pct,
            idle.cpu_used_pct,
        )
        later = datetime.now(UTC) + timedelta(hours=1)
        assert sbx.get_metrics(start=later) == []
        r = e2b_call(platform, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics", platform.key_b)
        assert r.status_code == 404, r.text
        r = e2b_call(platform, "GET", f"/sandboxes/{sbx.sandbox_id}/metrics", platform.key_a,
                     params={"start": "yesterday"})  # fmt: skip
        assert r.status_code in (400, 422) and r.json()["message"], r.text
        assert sbx.pause() is True
        assert sbx.get_metrics() == []  # nothing runs
    finally:
        sbx.kill()
    with pytest.raises(SandboxException):
        Sandbox.get_metrics(sbx.sandbox_id, **opts(platform))


def test_snapshots_start_sandboxes_as_they_were_and_are_their_tenants_alone(
    platform: Platform,
) -> None:
    b = opts(platform, platform.key_b)
    source = Sandbox.create(timeout=600, **opts(platform))
    made: list[Sandbox] = []
    try:
        source.commands.run("echo kept > /root/state")
        source.commands.run("sleep 1000 & echo $! > /root/pid", background=False)
        snap = source.create_snapshot()
        assert snap.snapshot_id.startswith("snap-") and snap.names == []
        named = source.create_snapshot(name="my-snap")
        assert named.names == ["my-snap"] and named.snapshot_id != "my-snap"
        # The source runs on, untouched.
        assert source.commands.run("cat /root/state").stdout == "kept\n"
        listed = Sandbox.list_snapshots(sandbox_id=source.sandbox_id, **opts(platform))
        assert {s.snapshot_id for s in listed.next_items()} == {
            snap.snapshot_id,
            named.snapshot_id,
        }
        by_name = Sandbox.list_snapshots(name="my-snap", **opts(platform)).next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        source.kill()  # a snapshot outlives its sandbox
        # Sandboxes of it start as it was: its files, and its processes running.
        for template in (snap.snapshot_id, "my-snap"):
            child = Sandbox.create(template=template, timeout=300, **opts(platform))
            made.append(child)
            assert child.commands.run("cat /root/state").stdout == "kept\n"
            child.commands.run("kill -0 $(cat /root/pid)")
        # Another tenant sees none of it, by id or by name, through E2B's API or SPACE's, and
        # cannot delete it.
        for template in (snap.snapshot_id, named.snapshot_id, "my-snap"):
            r = e2b_call(platform, "POST", "/v2/sandboxes", platform.key_b,
                         json={"templateID": template})  # fmt: skip
            assert r.status_code == 404 and r.json()["code"] == 404, r.text
        assert Sandbox.list_snapshots(**b).next_items() == []
        assert Sandbox.delete_snapshot(snap.snapshot_id, **b) is False
        with platform.client(platform.key_b) as c:
            ids = {t["id"] for t in c.get("/v1/templates").json()["items"]}
            assert snap.snapshot_id not in ids and named.snapshot_id not in ids
            for template in (snap.snapshot_id, named.snapshot_id):
                assert c.get(f"/v1/templates/{template}").status_code == 404
                r = c.post("/v1/sandboxes", json={"template": template})
                assert r.status_code == 404, r.text
        with platform.client() as c:
            ids = {t["id"] for t in c.get("/v1/templates").json()["items"]}
            assert {snap.snapshot_id, named.snapshot_id} <= ids
        with platform.client(platform.admin_key) as admin:  # no warm pool: claims look at no owner
            r = admin.put(f"/v1/templates/{snap.snapshot_id}/pool", json={"size": 1})
            assert r.status_code == 404, r.text
        # Not while a sandbox of it lives; then gone.
        r = e2b_call(platform, "DELETE", f"/templates/{snap.snapshot_id}", platform.key_a)
        assert r.status_code == 409 and made[0].sandbox_id in r.json()["message"], r.text
        # A snapshot of the same name replaces it: the name now starts the new state.
        first = made[0]
        first.commands.run("echo newer > /root/state")
        again = first.create_snapshot(name="my-snap")
        assert again.snapshot_id == named.snapshot_id and again.names == ["my-snap"]
        replaced = Sandbox.list_snapshots(name="my-snap", **opts(platform)).next_items()
        assert [s.snapshot_id for s in replaced] == [named.snapshot_id]
        of_first = Sandbox.list_snapshots(sandbox_id=first.sandbox_id, **opts(platform))
        assert [s.snapshot_id for s in of_first.next_items()] == [named.snapshot_id]
        newer = Sandbox.create(template="my-snap", timeout=300, **opts(platform))
        made.append(newer)
        assert newer.commands.run("cat /root/state").stdout == "newer\n"
        for child in made:
            child.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, **opts(platform)) is True
        assert Sandbox.delete_snapshot(named.snapshot_id, **opts(platform)) is True
        assert Sandbox.list_snapshots(**opts(platform)).next_items() == []
    finally:
        for sandbox in (*made, source):
            sandbox.kill()


def test_snapshot_bad_input_and_another_tenants_sandbox(platform: Platform) -> None:
    sbx = Sandbox.create(timeout=300, **opts(platform))
    try:
        path = f"/sandboxes/{sbx.sandbox_id}/snapshots"
        for body in ({"memory": False}, {"name": "Not A Name!"}, {"name": "x" * 60}):
            r = e2b_call(platform, "POST", path, platform.key_a, json=body)
            assert r.status_code == 400 and r.json()["message"], r.text
        r = e2b_call(platform, "POST", path, platform.key_b, json={})
        assert r.status_code == 404 and r.json()["code"] == 404, r.text
        r = e2b_call(platform, "GET", "/snapshots", platform.key_a, params={"nextToken": "x"})
        assert r.status_code == 400, r.text
        r = e2b_call(platform, "DELETE", "/templates/base", platform.key_a)
        assert r.status_code == 404, r.text  # only snapshots are a tenant's to delete
    finally:
        sbx.kill()


def test_snapshots_count_against_the_checkpoint_quota(platform: Platform) -> None:
    """A snapshot is a checkpoint kept: a tenant allowed one has one snapshot, and what it took
    to make it (a checkpoint) is let go."""
    key = key_with_quotas(platform.database_url, "snap", {"checkpoints": 1})
    sbx = Sandbox.create(timeout=300, **opts(platform, key))
    try:
        snap = sbx.create_snapshot()
        with platform.client(key) as c:
            assert c.get(f"/v1/sandboxes/{sbx.sandbox_id}/checkpoints").json()["items"] == []
            assert c.get("/v1/quotas").json()["used"]["checkpoints"] == 1
        r = e2b_call(platform, "POST", f"/sandboxes/{sbx.sandbox_id}/snapshots", key, json={})
        assert r.status_code == 429 and "checkpoints" in r.json()["message"], r.text
        assert Sandbox.delete_snapshot(snap.snapshot_id, **opts(platform, key)) is True
        with platform.client(key) as c:
            assert c.get("/v1/quotas").json()["used"]["checkpoints"] == 0
    finally:
        sbx.kill()


def test_signed_file_urls_open_one_file_one_way_until_they_expire(platform: Platform) -> None:
    sbx = Sandbox.create(timeout=300, **opts(platform))
    other = Sandbox.create(timeout=300, **opts(platform))
    port = urlsplit(platform.api_url).port

    def at_host(url: str, sandbox_id: str, method: str = "GET", **kw: Any) -> httpx.Response:
        """The URL as a browser would open it at the daemon's own host name (E2B_DOMAIN):
        no API key, no access token."""
        query = urlsplit(url).query
        host = f"49983-{sandbox_id}.localhost:{port}"
        return httpx.request(method, f"{platform.api_url}/files?{query}", headers={"Host": host},
                             timeout=60, **kw)  # fmt: skip

    try:
        sbx.files.write("/root/hello.txt", "hello")
        url = sbx.download_url("/root/hello.txt", use_signature_expiration=120)
        assert "signature=" in url and "signature_expiration=" in url
        r = at_host(url, sbx.sandbox_id)
        assert r.status_code == 200 and r.text == "hello", r.text
        assert at_host(sbx.download_url("/root/hello.txt"), sbx.sandbox_id).text == "hello"
        # Named by header instead of host name, as a plain client may.
        query = urlsplit(url).query
        r = httpx.get(f"{platform.api_url}/e2b/envd/files?{query}",
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id})  # fmt: skip
        assert r.status_code == 200 and r.text == "hello", r.text
        # Refused: another path, another sandbox, an altered signature or expiry, another user,
        # the other operation, an expired link, no sandbox named.
        assert at_host(url.replace("hello.txt", "other.txt"), sbx.sandbox_id).status_code == 401
        assert at_host(url, other.sandbox_id).status_code == 401
        signature = quote(parse_qs(urlsplit(url).query)["signature"][0], safe="")
        assert signature in url
        flipped = signature[:-1] + ("A" if signature[-1] != "A" else "B")
        assert at_host(url.replace(signature, flipped), sbx.sandbox_id).status_code == 401
        expires = parse_qs(urlsplit(url).query)["signature_expiration"][0]
        assert f"signature_expiration={expires}" in url
        later = url.replace(expires, str(int(expires) + 3600))
        assert at_host(later, sbx.sandbox_id).status_code == 401
        assert at_host(url + "&username=nobody", sbx.sandbox_id).status_code == 401
        assert at_host(url, sbx.sandbox_id, "POST", files={"file": b"x"}).status_code == 401
        expired = sbx.download_url("/root/hello.txt", use_signature_expiration=-5)
        r = at_host(expired, sbx.sandbox_id)
        assert r.status_code == 401 and "expired" in r.text, r.text
        for bad in ("²", "9" * 40):
            r = at_host(url.replace(expires, bad), sbx.sandbox_id)
            assert r.status_code == 400, r.text
        r = httpx.get(f"{platform.api_url}/e2b/envd/files?{query}")
        assert r.status_code == 400, r.text
        # An upload link writes that file, whatever name its part carries; one without a path
        # (whose parts would choose) is refused.
        up = sbx.upload_url("/root/uploaded.txt", use_signature_expiration=120)
        r = at_host(up, sbx.sandbox_id, "POST", files={"file": ("elsewhere.txt", b"from a link")})
        assert r.status_code == 200, r.text
        assert sbx.files.read("/root/uploaded.txt") == "from a link"
        assert not sbx.files.exists("/root/elsewhere.txt")
        assert at_host(up, sbx.sandbox_id).status_code == 401  # not a download link
        anywhere = sbx.upload_url("")
        r = at_host(anywhere, sbx.sandbox_id, "POST", files={"file": ("/etc/x", b"no")})
        assert r.status_code == 400, r.text
        # A link signed with a key's token ends with the key.
        with platform.client() as a, platform.client(platform.admin_key) as admin:
            tenant = a.get("/v1/me").json()["tenant_id"]
            made = admin.post(f"/v1/tenants/{tenant}/keys", json={"name": "links"}).json()
            second = Sandbox.connect(sbx.sandbox_id, **opts(platform, made["key"]))
            link = second.download_url("/root/hello.txt")
            assert at_host(link, sbx.sandbox_id).status_code == 200
            # A token names its key under the code: naming a sibling key opens nothing.
            token, other_token = sbx._envd_access_token, second._envd_access_token
            assert token and other_token and token != other_token
            swapped = ".".join([*token.split(".")[:-2], other_token.split(".")[-2],
                                token.split(".")[-1]])  # fmt: skip
            envd = f"{platform.api_url}/e2b/envd/process.Process/List"
            for t, status in ((token, 200), (other_token, 200), (swapped, 401)):
                r = httpx.post(envd, json={}, headers={"E2b-Sandbox-Id": sbx.sandbox_id,
                                                       "X-Access-Token": t})  # fmt: skip
                assert r.status_code == status, (t, r.text)
            assert admin.delete(f"/v1/tenants/{tenant}/keys/{made['id']}").status_code == 204
            assert at_host(link, sbx.sandbox_id).status_code == 401
    finally:
        sbx.kill()
        other.kill()

"""The worker API (docs/worker-api.md) end to end: a real uvicorn, a real VMManager, real VMs.

One worker serves the whole module (its own worker id, so its own directories in the pool);
tests share its VMs where they can, since every boot costs seconds under TCG.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import wsproto.events as wse
from httpx_ws import WebSocketUpgradeError, aconnect_ws

from space import release
from space.worker.api.server import serve
from space.worker.local import LocalRuntime
from space.worker.sandboxes import VMManager, VMManagerError
from space.worker.vmm.base import SnapshotInfo
from tests.vm.conftest import vmm_pids
from tests.worker.harness import free_port, manager

pytestmark = pytest.mark.vm

SECRET = "test-secret-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {SECRET}", "Space-Epoch": "1"}
COUNTER = (
    "nohup sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' "
    ">/dev/null 2>&1 & echo $!"
)


class Worker:
    """A VMManager served by `serve()` in this event loop, and an HTTP client for it."""

    def __init__(self, runtime: LocalRuntime, worker_id: str, capacity_vcpus: int = 8) -> None:
        self.runtime = runtime
        self.worker_id = worker_id
        self.capacity_vcpus = capacity_vcpus
        self.manager: VMManager
        self.http: httpx.AsyncClient
        self.url = ""
        self._server: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.manager = manager(self.runtime, self.worker_id, self.capacity_vcpus)
        await self.manager.start()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._server = asyncio.ensure_future(serve(self.manager, SECRET, "127.0.0.1", port))
        self.http = httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=180)
        for _ in range(200):
            try:
                if (await self.http.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                await asyncio.sleep(0.02)
        raise AssertionError("the worker did not come up")

    async def stop(self, stop_vms: bool) -> None:
        await self.http.aclose()
        if self._server is not None:
            self._server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await self._server
            self._server = None
        await self.manager.close(stop_vms=stop_vms)

    def pids(self) -> set[int]:
        """Our VMM processes: those whose command line is in this worker's directory."""
        root = str(self.manager.root).encode()
        found = set()
        for pid in vmm_pids():
            try:
                if root in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.add(pid)
            except OSError:
                continue
        return found

    async def exec(self, vm_id: str, **body: Any) -> list[dict[str, Any]]:
        resp = await self.http.post(f"/vms/{vm_id}/exec", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in resp.text.splitlines()]

    async def run(self, vm_id: str, cmd: str) -> str:
        events = await self.exec(vm_id, cmd=cmd)
        assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 0, events
        return stdout_of(events).decode()

    async def state(self, vm_id: str) -> str | None:
        health = (await self.http.get("/health")).json()
        return next((vm["state"] for vm in health["vms"] if vm["id"] == vm_id), None)


def stdout_of(events: list[dict[str, Any]], stream: str = "stdout") -> bytes:
    return b"".join(base64.b64decode(e["data"]) for e in events if e["type"] == stream)


async def counter(w: Worker, vm_id: str) -> int:
    # The loop rewrites the file: it can be missing or empty for an instant.
    return int((await w.run(vm_id, "cat /tmp/counter 2>/dev/null || true")).strip() or 0)


async def counter_advances(w: Worker, vm_id: str) -> bool:
    before = await counter(w, vm_id)
    for _ in range(50):
        await asyncio.sleep(0.2)
        if await counter(w, vm_id) > before:
            return True
    return False


async def process_ends(w: Worker, vm_id: str, pid: int) -> None:
    for _ in range(100):
        if (await w.exec(vm_id, argv=["kill", "-0", str(pid)]))[-1]["exit_code"] != 0:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"process {pid} outlived the stream that started it")


@pytest.fixture(scope="module")
async def worker(runtime: LocalRuntime) -> AsyncIterator[Worker]:
    w = Worker(runtime, f"test-{uuid.uuid4().hex[:8]}")
    await w.start()
    try:
        yield w
    finally:
        if w._server is not None:
            await w.stop(stop_vms=True)
        shutil.rmtree(w.manager.root, ignore_errors=True)


@pytest.fixture(scope="module")
async def vm(worker: Worker) -> str:
    """The module's main VM: the first create, which builds the base snapshot."""
    resp = await worker.http.put(
        "/vms/main", json={"template": "base", "env": {"FROM_SANDBOX": "yes", "BOTH": "sandbox"}}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["boot"] == "cold"
    return "main"


async def test_every_route_needs_the_secret(worker: Worker) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
        async with httpx.AsyncClient(base_url=worker.url, headers=headers) as anon:
            for method, path in (("GET", "/health"), ("PUT", "/vms/x"), ("GET", "/nowhere")):
                resp = await anon.request(method, path)
                assert resp.status_code == 401, (headers, path)
                assert resp.headers["content-type"] == "application/problem+json"
                assert resp.json()["status"] == 401
            with pytest.raises(WebSocketUpgradeError) as e:
                async with aconnect_ws(f"{worker.url}/vms/x/exec/ws", anon):
                    pass
            assert e.value.response.status_code == 401
    health = (await worker.http.get("/health")).json()
    assert health["worker_id"] == worker.worker_id
    # 1 GiB of it is the worker's reserve: what sandboxes may use is the rest.
    assert health["capacity"]["vcpus"] == 8 and health["capacity"]["memory_mib"] == 3072
    assert health["capacity"]["disk_mib"] > 0 and health["healthy"] is True


async def test_lifecycle_calls_are_fenced_by_the_leaders_epoch(worker: Worker) -> None:
    base = {"Authorization": f"Bearer {SECRET}"}
    async with httpx.AsyncClient(base_url=worker.url, headers=base, timeout=30) as c:
        resp = await c.delete("/vms/fenced")  # no epoch at all
        assert resp.status_code == 428 and resp.json()["code"] == "epoch_required"
        # A new leader's first probe raises the fence; the old leader's calls are refused.
        assert (await c.get("/health", headers={"Space-Epoch": "7"})).json()["epoch"] == 7
        resp = await c.delete("/vms/fenced", headers={"Space-Epoch": "6"})
        assert resp.status_code == 412 and resp.json()["code"] == "stale_epoch"
        assert "epoch 6 is stale" in resp.json()["detail"]
        assert (await c.get("/health", headers={"Space-Epoch": "1"})).status_code == 412
        assert (await c.delete("/vms/fenced", headers={"Space-Epoch": "7"})).status_code == 204
        # The data plane is not fenced: the API server holds no epoch.
        assert (await c.get("/vms/fenced/files/stat", params={"path": "/"})).status_code == 404
    # The fence is on disk: a restarted worker still refuses the old leader.
    assert (worker.manager.root / "epoch").read_text() == "7"
    AUTH["Space-Epoch"] = worker.http.headers["Space-Epoch"] = "7"  # for the tests after this


async def test_releases_one_minor_apart_work_together(worker: Worker, vm: str) -> None:
    """A caller's release rides on every call: one minor release apart is served (members a
    newer one adds are left out), further is refused naming both; /health answers anyone."""
    major, minor, _ = release.parse(release.VERSION)
    next_one, too_far = f"{major}.{minor + 1}.0", f"{major}.{minor + 2}.0"
    health = await worker.http.get("/health", headers={release.HEADER: too_far})
    assert health.status_code == 200 and health.json()["version"] == release.VERSION
    assert health.headers[release.HEADER] == release.VERSION
    refused = await worker.http.delete("/vms/x", headers={release.HEADER: too_far})
    assert refused.status_code == 426 and refused.json()["code"] == "incompatible_release"
    assert too_far in refused.json()["detail"] and release.VERSION in refused.json()["detail"]
    with pytest.raises(WebSocketUpgradeError) as e:
        async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http,
                               headers={release.HEADER: too_far}):  # fmt: skip
            pass
    assert e.value.response.status_code == 426
    body = {"cmd": "echo same", "member_of_a_later_release": True}
    newer = await worker.http.post(f"/vms/{vm}/exec", json=body,
                                   headers={release.HEADER: next_one})  # fmt: skip
    assert newer.status_code == 200, newer.text
    assert stdout_of([json.loads(x) for x in newer.text.splitlines()]) == b"same\n"
    for same in ({release.HEADER: release.VERSION}, {}):  # none: an 0.1 control plane
        typo = await worker.http.post(f"/vms/{vm}/exec", json=body, headers=same)
        assert typo.status_code == 400 and "member_of_a_later_release" in typo.text, typo.text


async def test_create_restores_the_base_snapshot_and_is_idempotent(worker: Worker, vm: str) -> None:
    started = time.perf_counter()
    resp = await worker.http.put("/vms/second", json={"hostname": "second-host"})
    elapsed = time.perf_counter() - started
    assert resp.status_code == 200, resp.text
    second = resp.json()
    assert (second["id"], second["state"], second["boot"]) == ("second", "running", "restore")
    cold = await worker.http.put(f"/vms/{vm}", json={"template": "base"})
    assert cold.json()["boot"] == "cold"  # the same answer again: nothing new was made
    assert second["took_ms"] * 5 < cold.json()["took_ms"], (second, cold.json())
    assert elapsed < 3, elapsed
    assert await worker.run("second", "hostname") == "second-host\n"
    # The restore maps the base snapshot's memory file, which every clone shares.
    base = worker.manager.layout.base / "base-1-256"
    assert SnapshotInfo.load(base).files["memory"] == "memory.bin"
    running = json.loads((worker.manager.layout.vms / "second" / "vm.json").read_text())
    mapped = (
        base
        if worker.manager.driver.shares_snapshot_memory
        else worker.manager.layout.vms / "second"
    )
    assert running["config"]["memory_file"] == str(mapped / "memory.bin")
    assert not running["config"]["memory_shared"] and not running["config"]["free_page_reporting"]
    again = await worker.http.put("/vms/second", json={"hostname": "second-host"})
    assert again.json() == second
    health = (await worker.http.get("/health")).json()
    entry = next(v for v in health["vms"] if v["id"] == "second")
    assert (entry["state"], entry["policy"], entry["crashed"]) == ("running", True, False)
    # Each VM counts its guest RAM and what its VMM costs beyond it.
    assert health["used"]["vcpus"] == 2
    assert health["used"]["memory_mib"] == 512 + 2 * health["overhead_mib"]
    assert (await worker.http.delete("/vms/second")).status_code == 204


async def test_concurrent_creates_share_one_base_build(worker: Worker, vm: str) -> None:
    shape = {"memory_mib": 192}
    answers = await asyncio.gather(
        worker.http.put("/vms/twin-a", json=shape),
        worker.http.put("/vms/twin-b", json=shape),
        worker.http.put("/vms/twin-b", json=shape),
    )
    assert [r.status_code for r in answers] == [200, 200, 200], [r.text for r in answers]
    assert sorted(r.json()["boot"] for r in answers[:2]) == ["cold", "restore"]
    assert answers[1].json() == answers[2].json()  # one VM, asked for twice at once
    assert sorted(p.name for p in worker.manager.layout.base.iterdir()) == [
        "base-1-192", "base-1-256",
    ]  # fmt: skip
    assert list(worker.manager.layout.building.iterdir()) == []
    for vm_id in ("twin-a", "twin-b"):
        assert (await worker.http.delete(f"/vms/{vm_id}")).status_code == 204


async def test_create_refuses_bad_requests_clearly(worker: Worker, vm: str) -> None:
    cases: list[tuple[Any, int, str]] = [
        (b"{not json", 400, "invalid request body"),
        ({"vcpus": 0}, 400, "vcpus"),
        ({"memory_mib": "lots"}, 400, "memory_mib"),
        ({"env": {"1BAD": "x"}}, 400, "env"),
        ({"surprise": 1}, 400, "surprise"),
        ({"template": "nope"}, 404, "no template 'nope'"),
        ({"vcpus": 9}, 507, "no room for 9 vCPUs"),
        ({"memory_mib": 8192}, 507, "no room for 8192 MiB"),
        ({"disk_mib": 1 << 20}, 507, "no room for"),
    ]
    for body, status, words in cases:
        kw: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
        resp = await worker.http.put("/vms/refused", **kw)
        assert resp.status_code == status, (body, resp.text)
        assert resp.headers["content-type"] == "application/problem+json"
        assert words in resp.json()["detail"], resp.json()
    resp = await worker.http.put("/vms/bad.id", json={})
    assert resp.status_code == 400
    resp = await worker.http.patch(f"/vms/{vm}", json={})
    assert resp.status_code == 405 and "PUT" in resp.headers["allow"]
    assert resp.headers["content-type"] == "application/problem+json"
    # An existing VM asked for with another shape is a conflict, not a silent success.
    resp = await worker.http.put(f"/vms/{vm}", json={"vcpus": 2})
    assert resp.status_code == 409 and resp.json()["state"] == "running"
    assert "refused" not in {v["id"] for v in (await worker.http.get("/health")).json()["vms"]}


async def test_exec_streams_ndjson_events(worker: Worker, vm: str) -> None:
    events = await worker.exec(
        vm,
        cmd='echo out; echo err >&2; echo "$FROM_SANDBOX $BOTH"; exit 3',
        env={"BOTH": "exec"},
    )
    assert events[0]["type"] == "start" and events[0]["pid"] > 1
    assert stdout_of(events) == b"out\nyes exec\n"
    assert stdout_of(events, "stderr") == b"err\n"
    end = events[-1]
    assert end["type"] == "exit"
    assert (end["exit_code"], end["signal"], end["timed_out"]) == (3, None, False)
    assert end["duration_ms"] > 0

    data = os.urandom(300_000)
    events = await worker.exec(vm, argv=["sha256sum"], stdin=base64.b64encode(data).decode())
    assert stdout_of(events).split()[0].decode() == hashlib.sha256(data).hexdigest()

    events = await worker.exec(vm, cmd="sleep 30", timeout=0.5)
    assert events[-1]["timed_out"] is True

    # A client that stops reading takes its process with it.
    async with worker.http.stream(
        "POST", f"/vms/{vm}/exec", json={"cmd": "exec sleep 1000"}
    ) as resp:
        lines = resp.aiter_lines()
        pid = json.loads(await anext(lines))["pid"]
    await process_ends(worker, vm, pid)

    # A lost agent connection is made again on the next call.
    machine = worker.manager.get(vm).machine
    assert machine is not None
    await machine.agent.close()
    assert await worker.run(vm, "echo back") == "back\n"

    events = await worker.exec(vm, argv=["/usr/bin/nope"])
    assert [e["type"] for e in events] == ["error"]
    assert events[0]["code"] == "not_found" and "/usr/bin/nope" in events[0]["message"]


async def test_exec_refuses_bad_bodies(worker: Worker, vm: str) -> None:
    for body in (
        {},
        {"cmd": "true", "argv": ["true"]},
        {"cmd": "cat", "stdin": "not base64!"},
        {"argv": []},
        {"cmd": "true", "cwd": "relative"},
        {"cmd": "true", "timeout": -1},
        {"cmd": "true", "pty": True},
    ):
        resp = await worker.http.post(f"/vms/{vm}/exec", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["detail"], resp.json()
    resp = await worker.http.post(f"/vms/{vm}/exec", content=b"[1, 2")
    assert resp.status_code == 400 and "invalid request body" in resp.json()["detail"]
    resp = await worker.http.post("/vms/nobody/exec", json={"cmd": "true"})
    assert resp.status_code == 404 and "no VM 'nobody'" in resp.json()["detail"]


async def ws_collect(ws: Any, until: bytes, timeout: float = 30) -> bytes:
    """Terminal output until `until` appears in it."""
    out = b""
    deadline = time.monotonic() + timeout
    while until not in out:
        msg = await ws.receive(timeout=max(0.1, deadline - time.monotonic()))
        assert isinstance(msg, wse.BytesMessage), msg
        assert msg.data[:1] == b"\x01"
        out += bytes(msg.data[1:])
    return out


async def ws_event(ws: Any) -> dict[str, Any]:
    """The next event, skipping output."""
    while True:
        msg = await ws.receive(timeout=30)
        if isinstance(msg, wse.TextMessage):
            event: dict[str, Any] = json.loads(msg.data)
            return event


async def ws_exit(ws: Any) -> dict[str, Any]:
    event = await ws_event(ws)
    assert event["type"] == "exit", event
    return event


async def test_websocket_exec_with_a_pty(worker: Worker, vm: str) -> None:
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"argv": ["sh"], "pty": True, "rows": 30, "cols": 90}))
        start = json.loads(await ws.receive_text(timeout=30))
        assert start["type"] == "start" and start["pid"] > 1
        await ws.send_bytes(b"echo hi-$((40+2)); tty; stty size\n")
        out = await ws_collect(ws, b"30 90")
        assert b"hi-42\r\n" in out and b"/dev/pts/" in out
        await ws.send_text(json.dumps({"resize": [40, 100]}))
        await ws.send_bytes(b"stty size\n")
        await ws_collect(ws, b"40 100")
        await ws.send_text(json.dumps({"bogus": True}))
        error = await ws_event(ws)  # the shell's prompt may come first
        assert error["type"] == "error" and error["code"] == "invalid"
        await ws.send_bytes(b"exit 7\n")
        end = await ws_exit(ws)
        assert (end["exit_code"], end["signal"], end["timed_out"]) == (7, None, False)


async def test_websocket_exec_pipes_stdin_and_reports_errors(worker: Worker, vm: str) -> None:
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"cmd": "cat; echo done >&2"}))
        assert json.loads(await ws.receive_text(timeout=30))["type"] == "start"
        await ws.send_bytes(b"through cat\n")
        assert await ws_collect(ws, b"through cat\n") == b"through cat\n"
        await ws.send_text(json.dumps({"eof": True}))
        msg = await ws.receive(timeout=30)
        assert isinstance(msg, wse.BytesMessage) and bytes(msg.data) == b"\x02done\n"
        assert (await ws_exit(ws))["exit_code"] == 0
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"argv": []}))
        error = json.loads(await ws.receive_text(timeout=30))
        assert error["type"] == "error" and error["status"] == 400, error
    async with aconnect_ws(f"{worker.url}/vms/nobody/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"cmd": "true"}))
        error = json.loads(await ws.receive_text(timeout=30))
        assert error["type"] == "error" and error["status"] == 404, error
    # A client that leaves takes its process with it.
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"cmd": "exec sleep 1000"}))
        pid = json.loads(await ws.receive_text(timeout=30))["pid"]
    await process_ends(worker, vm, pid)


async def test_websocket_input_a_process_does_not_read_holds_back_no_signal(
    worker: Worker, vm: str
) -> None:
    """Input waits for a process slow to take it (at most a window in the guest): a signal
    sent after it still passes; and input bigger than a window given in the first message
    reaches a process whose output is bigger still (nothing waits on what nobody reads)."""
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        await ws.send_text(json.dumps({"argv": ["sleep", "600"]}))
        assert json.loads(await ws.receive_text(timeout=30))["type"] == "start"
        for _ in range(3):
            await ws.send_bytes(bytes(512 << 10))
        await ws.send_text(json.dumps({"signal": 9}))
        end = await asyncio.wait_for(ws_exit(ws), 30)
        assert end["signal"] == 9
    # 6 MiB in, 24 MiB out: the input waits for room in the guest while the worker reads the
    # output (were the input written before the output is read, both would wait for ever once
    # the worker holds 16 MiB of unread output: the guest's acknowledgements wait behind it).
    data = os.urandom(6 << 20)
    async with aconnect_ws(f"{worker.url}/vms/{vm}/exec/ws", worker.http) as ws:
        first = {"cmd": "od -An -to1 -v", "stdin": base64.b64encode(data).decode()}
        await ws.send_text(json.dumps(first))
        assert json.loads(await ws.receive_text(timeout=30))["type"] == "start"
        await ws.send_text(json.dumps({"eof": True}))
        out = hashlib.sha256()
        while isinstance(msg := await ws.receive(timeout=120), wse.BytesMessage):
            out.update(bytes(msg.data[1:]))
        assert json.loads(msg.data)["exit_code"] == 0
    want = "".join(f" {b:03o}" + ("\n" if i % 16 == 15 else "") for i, b in enumerate(data))
    assert out.hexdigest() == hashlib.sha256(want.encode()).hexdigest()


async def test_files_stream_both_ways(worker: Worker, vm: str) -> None:
    size = 20 << 20
    digest = hashlib.sha256()

    async def blocks() -> AsyncIterator[bytes]:
        for _ in range(size // (1 << 20)):
            block = os.urandom(1 << 20)
            digest.update(block)
            yield block

    files = f"/vms/{vm}/files"
    resp = await worker.http.put(
        files, params={"path": "/root/up/blob", "make_parents": "true", "mode": 0o600},
        content=blocks(),
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"size": size}
    assert (await worker.run(vm, "sha256sum /root/up/blob")).split()[0] == digest.hexdigest()

    back = hashlib.sha256()
    async with worker.http.stream("GET", files, params={"path": "/root/up/blob"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "application/octet-stream"
        async for chunk in resp.aiter_bytes():
            back.update(chunk)
    assert back.hexdigest() == digest.hexdigest()

    stat = (await worker.http.get(f"{files}/stat", params={"path": "/root/up/blob"})).json()
    assert (stat["name"], stat["type"], stat["size"], stat["mode"]) == ("blob", "file", size, 0o600)
    made = await worker.http.post(f"{files}/mkdir", params={"path": "/root/up/a/b"})
    assert made.status_code == 200 and made.json()["type"] == "directory"
    listing = (await worker.http.get(f"{files}/list", params={"path": "/root/up"})).json()
    assert [(e["name"], e["type"]) for e in listing["entries"]] == [
        ("a", "directory"), ("blob", "file"),
    ]  # fmt: skip
    empty = await worker.http.put(files, params={"path": "/root/up/empty"}, content=b"")
    assert empty.json() == {"size": 0}
    assert (await worker.http.get(files, params={"path": "/root/up/empty"})).content == b""

    not_empty = await worker.http.delete(files, params={"path": "/root/up"})
    assert not_empty.status_code == 409 and not_empty.json()["code"] == "not_empty"
    gone = await worker.http.delete(files, params={"path": "/root/up", "recursive": "true"})
    assert gone.status_code == 204
    for method, path in (("GET", files), ("GET", f"{files}/stat"), ("GET", f"{files}/list"),
                         ("DELETE", files)):  # fmt: skip
        resp = await worker.http.request(method, path, params={"path": "/root/up/blob"})
        assert resp.status_code == 404, (method, path, resp.text)
        assert resp.json()["code"] == "not_found"
    assert (await worker.http.get(files, params={"path": "/root"})).status_code == 400
    for params in ({"path": "relative"}, {}, {"path": "/x", "mode": "rw"}):
        resp = await worker.http.put(files, params=params, content=b"x")
        assert resp.status_code == 400, (params, resp.text)
    exists = await worker.http.post(f"{files}/mkdir", params={"path": "/root", "parents": "0"})
    assert exists.status_code == 409


async def test_pause_resume_keeps_a_process_alive(worker: Worker, vm: str) -> None:
    pid = (await worker.run(vm, COUNTER)).strip()
    assert await counter_advances(worker, vm)
    assert (await worker.http.post(f"/vms/{vm}/pause")).json()["state"] == "paused"
    assert (await worker.http.post(f"/vms/{vm}/pause")).json()["state"] == "paused"
    assert await worker.state(vm) == "paused"
    for method, path in (("POST", "exec"), ("GET", "files/stat?path=/"), ("GET", "files?path=/x")):
        resp = await worker.http.request(method, f"/vms/{vm}/{path}", json={"cmd": "true"})
        assert resp.status_code == 409, (path, resp.text)
        assert resp.json()["state"] == "paused"
    assert (await worker.http.post(f"/vms/{vm}/resume")).json()["state"] == "running"
    assert (await worker.http.post(f"/vms/{vm}/resume")).json()["state"] == "running"
    assert await worker.run(vm, f"kill -0 {pid} && echo alive") == "alive\n"
    assert await counter_advances(worker, vm)
    await worker.run(vm, f"kill {pid}")
    for verb in ("pause", "resume", "suspend"):
        assert (await worker.http.post(f"/vms/nobody/{verb}")).status_code == 404


async def test_suspend_and_resume_keep_processes_and_files(worker: Worker) -> None:
    assert (await worker.http.put("/vms/sleeper", json={"hostname": "sleepy"})).status_code == 200
    pid = (await worker.run("sleeper", COUNTER)).strip()
    await worker.http.put("/vms/sleeper/files", params={"path": "/root/kept"}, content=b"kept")
    assert await counter_advances(worker, "sleeper")
    pids_before = worker.pids()

    resp = await worker.http.post("/vms/sleeper/suspend")
    assert resp.json()["state"] == "suspended", resp.text
    assert (await worker.http.post("/vms/sleeper/suspend")).json()["state"] == "suspended"
    assert await worker.state("sleeper") == "suspended"
    assert len(pids_before - worker.pids()) == 1  # its VMM process is gone
    assert (worker.manager.layout.suspended / "sleeper" / "snapshot.json").exists()
    assert not (worker.manager.layout.vms / "sleeper").exists()
    resp = await worker.http.post("/vms/sleeper/exec", json={"cmd": "true"})
    assert resp.status_code == 409 and resp.json()["state"] == "suspended"
    assert (await worker.http.post("/vms/sleeper/pause")).status_code == 409
    health = (await worker.http.get("/health")).json()
    assert health["used"]["vcpus"] == 2  # a suspended VM keeps the room its resume needs

    started = time.perf_counter()
    assert (await worker.http.post("/vms/sleeper/resume")).json()["state"] == "running"
    assert time.perf_counter() - started < 3
    assert not (worker.manager.layout.suspended / "sleeper").exists()
    assert await worker.run("sleeper", f"kill -0 {pid} && echo alive") == "alive\n"
    assert await counter_advances(worker, "sleeper")
    kept = await worker.http.get("/vms/sleeper/files", params={"path": "/root/kept"})
    assert kept.content == b"kept"
    assert await worker.run("sleeper", "hostname") == "sleepy\n"
    # Suspended straight from paused, too.
    await worker.http.post("/vms/sleeper/pause")
    assert (await worker.http.post("/vms/sleeper/suspend")).json()["state"] == "suspended"
    assert (await worker.http.post("/vms/sleeper/resume")).json()["state"] == "running"
    assert await worker.run("sleeper", f"kill {pid} && cat /root/kept") == "kept"


async def test_delete_removes_everything_and_is_idempotent(worker: Worker) -> None:
    await worker.http.put("/vms/doomed", json={})
    await worker.http.post("/vms/doomed/suspend")
    await worker.http.put("/vms/doomed2", json={})
    assert (worker.manager.layout.vms / "doomed2").is_dir()
    assert (worker.manager.layout.suspended / "doomed").is_dir()
    pids = worker.pids()
    for vm_id in ("doomed", "doomed2"):
        assert (await worker.http.delete(f"/vms/{vm_id}")).status_code == 204
        assert (await worker.http.delete(f"/vms/{vm_id}")).status_code == 204
        assert (
            await worker.http.post(f"/vms/{vm_id}/exec", json={"cmd": "true"})
        ).status_code == 404
        assert await worker.state(vm_id) is None
    assert not (worker.manager.layout.vms / "doomed2").exists()
    assert not (worker.manager.layout.suspended / "doomed").exists()
    assert len(pids - worker.pids()) == 1


async def test_a_vm_whose_vmm_died_says_so_and_boots_again_from_its_disk(worker: Worker) -> None:
    pids = worker.pids()
    await worker.http.put("/vms/crashing", json={})
    await worker.run("crashing", "echo survived > /root/file && sync")
    (pid,) = worker.pids() - pids
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        health = (await worker.http.get("/health")).json()
        entry = next(v for v in health["vms"] if v["id"] == "crashing")
        if entry["state"] == "error":
            break
        await asyncio.sleep(0.05)
    assert "killed by signal 9" in entry["reason"] and entry["crashed"], entry
    resp = await worker.http.post("/vms/crashing/exec", json={"cmd": "true"})
    assert resp.status_code == 409 and "killed by signal 9" in resp.json()["detail"]
    assert (await worker.http.post("/vms/crashing/pause")).status_code == 409
    # Its disk is kept: a create of it boots it again from there, with its files.
    assert (worker.manager.layout.vms / "crashing" / "disk.img").exists()
    again = await worker.http.put("/vms/crashing", json={})
    assert again.status_code == 200 and again.json()["boot"] == "reboot", again.text
    assert await worker.run("crashing", "cat /root/file") == "survived\n"
    entry = next(v for v in (await worker.http.get("/health")).json()["vms"]
                 if v["id"] == "crashing")  # fmt: skip
    assert entry["state"] == "running" and entry["rebooted"] and not entry["crashed"]
    assert (await worker.http.delete("/vms/crashing")).status_code == 204
    assert not (worker.manager.layout.vms / "crashing").exists()


async def test_a_restarted_worker_adopts_its_vms(worker: Worker, vm: str) -> None:
    await worker.http.put("/vms/napping", json={})
    await worker.run("napping", "echo before > /root/mark")
    await worker.http.post("/vms/napping/pause")
    await worker.http.put("/vms/dormant", json={})
    await worker.http.post("/vms/dormant/suspend")
    pids = worker.pids()
    await worker.http.put("/vms/victim", json={})
    (victim,) = worker.pids() - pids
    main_pid = (await worker.run(vm, "sleep 1000 >/dev/null 2>&1 & echo $!")).strip()

    await worker.run("victim", "echo mine > /root/mine && sync")
    with pytest.raises(VMManagerError, match="another process runs worker"):
        await manager(worker.runtime, worker.worker_id).start()
    await worker.stop(stop_vms=False)
    assert worker.pids() == pids | {victim}  # the VMs outlived their worker
    os.kill(victim, signal.SIGKILL)  # one dies while no worker watches
    (worker.manager.layout.vms / "halfmade").mkdir()  # a create cut short: no sandbox.json
    await worker.start()

    states = {v["id"]: v["state"] for v in (await worker.http.get("/health")).json()["vms"]}
    assert states == {vm: "running", "sleeper": "running", "napping": "paused",
                      "dormant": "suspended", "victim": "error"}  # fmt: skip
    assert worker.pids() == pids
    # The dead one is kept (its disk is the sandbox's); only the half-made create is gone.
    assert sorted(p.name for p in worker.manager.layout.vms.iterdir()) == [
        vm, "napping", "sleeper", "victim",
    ]  # fmt: skip
    assert (await worker.http.put("/vms/victim", json={})).json()["boot"] == "reboot"
    assert await worker.run("victim", "cat /root/mine") == "mine\n"
    assert (await worker.http.delete("/vms/victim")).status_code == 204
    assert await worker.run(vm, f"kill -0 {main_pid} && kill {main_pid} && echo ok") == "ok\n"
    assert (await worker.exec(vm, cmd="echo $FROM_SANDBOX"))[1]["data"] == "eWVzCg=="  # yes\n
    assert (await worker.http.post("/vms/napping/exec", json={"cmd": "true"})).status_code == 409
    assert (await worker.http.post("/vms/napping/resume")).json()["state"] == "running"
    assert await worker.run("napping", "cat /root/mark") == "before\n"
    assert (await worker.http.post("/vms/dormant/resume")).json()["state"] == "running"
    assert await worker.run("dormant", "echo awake") == "awake\n"
    again = await worker.http.put(f"/vms/{vm}", json={})
    assert again.json()["boot"] == "cold"  # what it was made by, remembered across the restart


async def test_a_vm_found_dead_at_start_is_not_spared_as_young(worker: Worker) -> None:
    """A VM whose VMM died while no worker ran has nothing in flight: /reconcile removes it at
    once if the database no longer wants it (a delete finished while its worker was away)."""
    before = worker.pids()
    await worker.http.put("/vms/corpse", json={})
    (corpse,) = worker.pids() - before
    await worker.stop(stop_vms=False)
    os.kill(corpse, signal.SIGKILL)
    for _ in range(200):  # gone before the worker starts, not while it adopts
        if corpse not in worker.pids():
            break
        await asyncio.sleep(0.05)
    await worker.start()
    grace, worker.manager.reconcile_grace_s = worker.manager.reconcile_grace_s, 3600
    try:
        # Every other VM was adopted just now, alive: those the grace still spares.
        resp = await worker.http.post("/reconcile", json={"keep": []})
        assert resp.json() == {"removed": ["corpse"]}, resp.text
    finally:
        worker.manager.reconcile_grace_s = grace
    assert not (worker.manager.layout.vms / "corpse").exists()
    assert worker.pids() == before


async def test_reconcile_removes_what_is_not_wanted(worker: Worker, vm: str) -> None:
    await worker.http.post("/vms/dormant/suspend")
    stray = worker.manager.layout.vms / "stray"
    stray.mkdir()
    (stray / "junk").write_text("left by nobody")
    keep = {"keep": [vm, "sleeper", "unknown"]}
    # VMs made (or adopted) moments ago survive: the keep-list may have been read before them.
    worker.manager.reconcile_grace_s = 3600
    resp = await worker.http.post("/reconcile", json=keep)
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"removed": ["stray"]}
    worker.manager.reconcile_grace_s = 0
    assert (await worker.http.post("/reconcile", json=keep)).json() == {
        "removed": ["dormant", "napping"]
    }
    states = {v["id"] for v in (await worker.http.get("/health")).json()["vms"]}
    assert states == {vm, "sleeper"}
    assert sorted(p.name for p in worker.manager.layout.vms.iterdir()) == [vm, "sleeper"]
    assert list(worker.manager.layout.suspended.iterdir()) == []
    assert len(worker.pids()) == 2
    for body in ({}, {"keep": "main"}, {"keep": [1]}):
        assert (await worker.http.post("/reconcile", json=body)).status_code == 400


async def test_a_snapshot_that_cannot_restore_never_replaces_a_live_vm(worker: Worker) -> None:
    """A `suspended/<id>/` holding only sandbox.json beside the running VM (a disk error, an
    operator's copy): the restarted worker keeps the VM, and sets the snapshot aside, kept."""
    assert (await worker.http.put("/vms/alive", json={})).status_code == 200
    await worker.run("alive", "echo mine > /root/mine && sync")
    pids = worker.pids()
    broken = worker.manager.layout.suspended / "alive"
    broken.mkdir()
    shutil.copy(worker.manager.layout.vms / "alive" / "sandbox.json", broken / "sandbox.json")
    await worker.stop(stop_vms=False)
    await worker.start()
    states = {v["id"]: v["state"] for v in (await worker.http.get("/health")).json()["vms"]}
    assert states["alive"] == "running"
    assert worker.pids() == pids, "the live VM was not killed"
    assert await worker.run("alive", "cat /root/mine") == "mine\n"
    assert not broken.exists()
    (aside,) = worker.manager.layout.suspended.glob(".unrestorable-alive.*")
    assert (aside / "sandbox.json").exists()
    await worker.stop(stop_vms=False)
    await worker.start()  # and it stays set aside across another restart
    assert (aside / "sandbox.json").exists()
    assert (await worker.http.delete("/vms/alive")).status_code == 204
    shutil.rmtree(aside)  # what an operator does once they have looked at it


async def test_nothing_is_left_behind(worker: Worker, vm: str) -> None:
    assert (await worker.http.post("/reconcile", json={"keep": []})).json() == {
        "removed": [vm, "sleeper"]
    }
    assert worker.pids() == set()
    await worker.stop(stop_vms=True)
    for d in (
        worker.manager.layout.vms,
        worker.manager.layout.suspended,
        worker.manager.layout.building,
    ):
        assert list(d.iterdir()) == []

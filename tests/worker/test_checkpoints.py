"""Checkpoints, rollbacks and forks through the worker API, with real VMs.

The worker here has room for 3 vCPUs, so a fork that asks for more children than fit fails
halfway for real (the last children find no room after the first ones were made).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import AsyncIterator

import pytest

from space.worker.local import LocalRuntime, local_runtime
from tests.worker.test_service import COUNTER, Worker, counter_advances

pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
async def worker() -> AsyncIterator[Worker]:
    runtime: LocalRuntime = await local_runtime()
    w = Worker(runtime, f"test-ck-{uuid.uuid4().hex[:6]}", capacity_vcpus=3)
    await w.start()
    try:
        yield w
    finally:
        await w.stop(stop_vms=True)
        shutil.rmtree(w.manager.root, ignore_errors=True)


async def alive(w: Worker, vm_id: str, pid: str) -> bool:
    events = await w.exec(vm_id, argv=["kill", "-0", pid])
    return bool(events[-1]["exit_code"] == 0)


async def test_rollback_restores_files_and_running_processes(worker: Worker) -> None:
    assert (await worker.http.put("/vms/ck", json={"hostname": "ck"})).status_code == 200
    pid = (await worker.run("ck", COUNTER)).strip()
    await worker.run("ck", "echo before > /root/a")
    resp = await worker.http.post("/vms/ck/checkpoints/c1")
    assert resp.status_code == 200, resp.text
    taken = resp.json()
    assert taken["size_bytes"] > 0 and taken["paused_ms"] > 0
    on_disk = worker.manager.layout.checkpoints / "ck" / "c1"
    assert (on_disk / "snapshot.json").exists()
    assert (await worker.http.post("/vms/ck/checkpoints/c1")).status_code == 200  # idempotent
    assert await worker.state("ck") == "running"
    assert await counter_advances(worker, "ck")  # it ran on after the checkpoint

    await worker.run("ck", f"echo after > /root/a; echo new > /root/b; kill {pid}")
    assert not await alive(worker, "ck", pid)
    resp = await worker.http.post("/vms/ck/checkpoints/c1/rollback")
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "running"
    assert await worker.run("ck", "cat /root/a") == "before\n"
    assert await worker.run("ck", "test -e /root/b || echo gone") == "gone\n"
    assert await alive(worker, "ck", pid)
    assert await counter_advances(worker, "ck")
    assert await worker.run("ck", "hostname") == "ck\n"
    assert len(worker.pids()) == 1  # the old VMM went

    assert (await worker.http.delete("/vms/ck/checkpoints/c1")).status_code == 204
    assert not on_disk.exists()
    assert (await worker.http.post("/vms/ck/checkpoints/c1/rollback")).status_code == 404
    assert (await worker.http.post("/vms/ck/checkpoints/c2")).status_code == 200
    assert (await worker.http.delete("/vms/ck")).status_code == 204
    assert not (worker.manager.layout.checkpoints / "ck").exists()  # its checkpoints went too


async def test_fork_children_diverge_and_the_parent_runs_on(worker: Worker) -> None:
    assert (await worker.http.put("/vms/parent", json={"env": {"A": "parent"}})).status_code == 200
    pid = (await worker.run("parent", COUNTER)).strip()
    await worker.run("parent", "echo shared > /root/shared")
    body = {"children": [{"id": "kid1", "env": {"A": "one"}}, {"id": "kid2", "hostname": "two"}]}
    resp = await worker.http.post("/vms/parent/fork", json=body)
    assert resp.status_code == 200, resp.text
    forked = resp.json()
    assert [c["id"] for c in forked["children"]] == ["kid1", "kid2"]
    assert all(c["state"] == "running" and c["boot"] == "fork" for c in forked["children"])
    assert forked["paused_ms"] > 0

    vms = ("parent", "kid1", "kid2")
    for vm in vms:
        assert await alive(worker, vm, pid), vm  # started before the fork, runs on in all
        assert await counter_advances(worker, vm), vm
        assert await worker.run(vm, "cat /root/shared") == "shared\n"
    await worker.run("kid1", "echo mine > /root/only-kid1")
    for vm in ("parent", "kid2"):
        assert await worker.run(vm, "test -e /root/only-kid1 || echo no") == "no\n"
    randoms = {await worker.run(vm, "head -c 16 /dev/urandom | od -An -tx1") for vm in vms}
    assert len(randoms) == 3
    assert await worker.run("kid1", "echo $A") == "one\n"
    assert await worker.run("parent", "echo $A") == "parent\n"
    assert await worker.run("kid1", "hostname") == "sb-kid1\n"
    assert await worker.run("kid2", "hostname") == "two\n"
    assert not list((worker.manager.layout.checkpoints / "parent").glob(".*"))
    # Two children map one file of the parent's memory (removed once they run), not a copy each
    # (a jailed QEMU that opens it for writing maps a reflink of its own).
    files = {worker.manager.get(vm).live_machine("test").vm.config.memory_file for vm in vms[1:]}
    if worker.manager.driver.shares_snapshot_memory:
        (memory,) = files
        assert memory is not None and memory.name == "memory.bin" and not memory.exists()
    else:
        assert files == {worker.manager.layout.vms / vm / "memory.bin" for vm in vms[1:]}
    assert not list(worker.manager.layout.building.iterdir())  # nor the VM that made it
    for vm in ("kid1", "kid2"):
        assert (await worker.http.delete(f"/vms/{vm}")).status_code == 204


async def test_fork_from_a_checkpoint(worker: Worker) -> None:
    await worker.run("parent", "echo then > /root/when")
    assert (await worker.http.post("/vms/parent/checkpoints/then")).status_code == 200
    await worker.run("parent", "echo now > /root/when")
    body = {"children": [{"id": "kid3"}], "checkpoint": "then"}
    resp = await worker.http.post("/vms/parent/fork", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["paused_ms"] == 0
    assert await worker.run("kid3", "cat /root/when") == "then\n"
    assert await worker.run("parent", "cat /root/when") == "now\n"
    assert (await worker.http.delete("/vms/kid3")).status_code == 204


async def test_a_fork_that_fails_halfway_leaves_nothing(worker: Worker) -> None:
    """Room for two children only: the third is refused after the first two were made."""
    before = worker.pids()
    body = {"children": [{"id": f"many{i}"} for i in range(3)]}
    resp = await worker.http.post("/vms/parent/fork", json=body)
    assert resp.status_code == 507, resp.text
    assert worker.pids() == before
    assert sorted(p.name for p in worker.manager.layout.vms.iterdir()) == ["parent"]
    assert [p.name for p in (worker.manager.layout.checkpoints / "parent").iterdir()] == ["then"]
    health = (await worker.http.get("/health")).json()
    assert [vm["id"] for vm in health["vms"]] == ["parent"]
    assert health["used"]["vcpus"] == 1


async def test_bad_requests_are_refused_clearly(worker: Worker) -> None:
    if await worker.state("parent") is None:
        assert (await worker.http.put("/vms/parent", json={})).status_code == 200
    assert (await worker.http.post("/vms/parent/fork", json={"children": []})).status_code == 400
    dup = {"children": [{"id": "same"}, {"id": "same"}]}
    assert (await worker.http.post("/vms/parent/fork", json=dup)).status_code == 400
    taken = {"children": [{"id": "parent"}]}
    assert (await worker.http.post("/vms/parent/fork", json=taken)).status_code == 409
    none = {"children": [{"id": "x1"}], "checkpoint": "nope"}
    assert (await worker.http.post("/vms/parent/fork", json=none)).status_code == 404
    assert (await worker.http.post("/vms/nobody/checkpoints/c1")).status_code == 404
    assert (await worker.http.post("/vms/parent/checkpoints/.bad")).status_code in (400, 404)
    await worker.http.post("/vms/parent/pause")
    assert (await worker.http.post("/vms/parent/checkpoints/c9")).status_code == 409
    await worker.http.post("/vms/parent/resume")
    unfenced = await worker.http.post("/vms/parent/checkpoints/c9", headers={"Space-Epoch": ""})
    assert unfenced.status_code in (400, 428)
    assert (await worker.http.delete("/vms/parent")).status_code == 204
    assert not (worker.manager.layout.checkpoints / "parent").exists()


async def test_a_template_of_a_checkpoint_that_does_not_restore_leaves_nothing(
    worker: Worker,
) -> None:
    """The base snapshot is made before the build says ready; if that fails, the template is
    removed again and the worker does not offer it."""
    assert (await worker.http.put("/vms/tsrc", json={"hostname": "tsrc"})).status_code == 200
    assert (await worker.http.post("/vms/tsrc/checkpoints/t1")).status_code == 200
    name = f"cut-{uuid.uuid4().hex[:6]}"

    async def build(body: dict[str, object], template: str = name) -> int:
        resp = await worker.http.post(f"/templates/{template}/builds", json=body)
        return resp.status_code

    good = {"checkpoint": {"vm_id": "tsrc", "checkpoint_id": "t1"}}
    assert await build({"checkpoint": {"vm_id": "tsrc", "checkpoint_id": "nope"}}) == 400
    assert await build(good, "base") == 400
    assert await build({**good, "spec": "[template]"}) == 400
    state = worker.manager.layout.checkpoints / "tsrc" / "t1" / "state.bin"
    state.write_bytes(state.read_bytes()[: 1 << 20])  # a stream cut short: it cannot load
    resp = await worker.http.post(f"/templates/{name}/builds", json=good)
    assert resp.status_code == 202, resp.text
    build_id = resp.json()["id"]
    for _ in range(600):
        status = (await worker.http.get(f"/builds/{build_id}")).json()
        if status["state"] != "building":
            break
        await asyncio.sleep(0.1)
    assert status["state"] == "failed" and status["record"] is None, status
    assert status["error"].startswith("checkpoint t1 did not restore: "), status
    assert not (worker.manager.pool.root / "templates" / name).exists()
    assert name not in worker.manager.records
    resp = await worker.http.put("/vms/tuser", json={"template": name})
    assert resp.status_code == 404, resp.text
    await worker.http.delete("/vms/tsrc")


async def test_a_template_of_a_checkpoint_whose_memory_no_longer_loads_boots_from_its_files(
    worker: Worker,
) -> None:
    assert (await worker.http.put("/vms/tsrc2", json={"hostname": "tsrc2"})).status_code == 200
    pid = (await worker.run("tsrc2", COUNTER)).strip()
    await worker.run("tsrc2", "echo kept > /root/kept")
    assert (await worker.http.post("/vms/tsrc2/checkpoints/t2")).status_code == 200
    name = f"kept-{uuid.uuid4().hex[:6]}"
    body = {"checkpoint": {"vm_id": "tsrc2", "checkpoint_id": "t2"}}
    resp = await worker.http.post(f"/templates/{name}/builds", json=body)
    assert resp.status_code == 202, resp.text
    for _ in range(600):
        if (await worker.http.get(f"/builds/{resp.json()['id']}")).json()["state"] != "building":
            break
        await asyncio.sleep(0.1)
    record = worker.manager.records[name]
    try:
        assert (await worker.http.put("/vms/tkid", json={"template": name})).json()["boot"] == (
            "restore"
        )
        assert await alive(worker, "tkid", pid)
        await worker.http.delete("/vms/tkid")
        # Another QEMU or kernel: neither its base snapshot nor its checkpoint loads any more.
        assert record.snapshot_path is not None
        state = record.snapshot_path / "state.bin"
        state.write_bytes(state.read_bytes()[: 1 << 20])
        shutil.rmtree(worker.manager.layout.base / f"{name}-1-256")
        resp = await worker.http.put("/vms/tkid", json={"template": name})
        assert resp.status_code == 200 and resp.json()["boot"] == "cold", resp.text
        assert await worker.run("tkid", "cat /root/kept") == "kept\n"
        # Its files, not its processes: no counter loop runs (the pattern does not match itself).
        assert await worker.run("tkid", "grep -l 'whil[e] true' /proc/[0-9]*/cmdline; true") == ""
    finally:
        for vm in ("tkid", "tsrc2"):
            await worker.http.delete(f"/vms/{vm}")
        await worker.http.delete(f"/templates/{name}")

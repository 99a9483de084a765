"""kill -9 at every named step of create, claim, suspend, resume and delete (the process kills
itself there: `space.crashpoints`), then the process started again: no sandbox is lost, a
suspended sandbox resumes with its files and processes, states converge, nothing leaks."""

from __future__ import annotations

import httpx
import pytest

from ..leaks import resources
from ..platform.helpers import counter_runs, create, run, start_counter, wait_state
from ..stack import Platform, Service
from .conftest import listening, record, restarted, shown_active, until

pytestmark = pytest.mark.vm

CONVERGE_S = 30.0  # from the process's restart to the sandbox in the state it was asked for

WORKER_STEPS = [
    "create.after-network", "create.after-vmm", "create.before-record",
    "suspend.after-snapshot", "suspend.after-publish", "suspend.after-stop",
    "resume.after-restore", "resume.after-consume", "resume.after-cont",
    "delete.after-stop", "delete.after-files",
]  # fmt: skip
SETTLED = {"create": "running", "suspend": "suspended", "resume": "running", "delete": "deleted"}


def _state(c: httpx.Client, sid: str) -> str:
    return str(c.get(f"/v1/sandboxes/{sid}").json()["state"])


def _asked(c: httpx.Client, method: str, path: str) -> int:
    """Ask without waiting; the status, 2xx unless the request was refused."""
    r = c.request(method, path, params={"wait": "false"})
    assert r.status_code < 300, r.text
    return r.status_code


def _died(svc: Service) -> bool:
    return svc.proc is not None and svc.proc.poll() is not None


def _settle_leaks(platform: Platform, before: dict[str, object]) -> None:
    until(lambda: resources([platform.worker_id]) == before, 30, step=0.5,
          why=lambda: f"left: {before} -> {resources([platform.worker_id])}")  # fmt: skip


@pytest.mark.parametrize("step", WORKER_STEPS)
def test_a_worker_killed_at_a_step_loses_nothing(
    platform: Platform, worker: Service, step: str
) -> None:
    verb = step.split(".")[0]
    before = resources([platform.worker_id])
    with platform.client() as c:
        sid, pid = "", 0
        if verb != "create":
            sid = create(c)["id"]
            pid = start_counter(c, sid)
            run(c, sid, "echo kept > /root/kept && sync")
        if verb == "resume":
            assert c.post(f"/v1/sandboxes/{sid}/suspend").json()["state"] == "suspended"
        with restarted(worker, SPACE_CRASH_AT=step):
            until(lambda: listening(worker), 60)
            shown_active(platform, platform.worker_id)
            if sid:  # (a slow restart can have shown the worker lost meanwhile)
                was = "suspended" if verb == "resume" else "running"
                until(lambda: _state(c, sid) == was, 30, why=lambda: _state(c, sid))
            if verb == "create":
                r = c.post("/v1/sandboxes", params={"wait": "false"}, json={})
                assert r.status_code in (201, 202), r.text
                sid = r.json()["id"]
            elif verb == "delete":
                assert _asked(c, "DELETE", f"/v1/sandboxes/{sid}") < 300
            else:
                assert _asked(c, "POST", f"/v1/sandboxes/{sid}/{verb}") < 300
            until(lambda: _died(worker), 60, why=lambda: f"{_state(c, sid)}\n{platform.logs()}")
        # The worker is back without its crash point.
        converged = until(
            lambda: _state(c, sid) == SETTLED[verb], 90, step=0.2,
            why=lambda: f"{c.get(f'/v1/sandboxes/{sid}').text}\n"
                        f"{c.get(f'/v1/sandboxes/{sid}/events').text}\n{platform.logs()}",
        )  # fmt: skip
        record(f"worker killed at {step}", f"the sandbox {SETTLED[verb]}", CONVERGE_S, converged)
        if verb in ("suspend", "resume"):
            if verb == "suspend":
                assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
            assert counter_runs(c, sid, pid), "its processes ran on"
            assert run(c, sid, "cat /root/kept")[0] == b"kept\n"
        elif verb == "create":
            assert run(c, sid, "echo ok")[0] == b"ok\n"
        if verb != "delete":
            c.delete(f"/v1/sandboxes/{sid}")
    _settle_leaks(platform, before)


@pytest.fixture
def pool_of_one(platform: Platform) -> object:
    with platform.client(platform.admin_key) as admin:
        assert admin.put("/v1/templates/base/pool", json={"size": 1}).status_code == 200
        until(lambda: admin.get("/v1/templates/base").json()["pool"]["ready"] == 1, 120)
        yield admin
        admin.put("/v1/templates/base/pool", json={"size": 0})


def _live_ids(c: httpx.Client) -> set[str]:
    items = c.get("/v1/sandboxes", params={"limit": 500}).json()["items"]
    return {s["id"] for s in items if s["state"] != "deleted"}


def _members(admin: httpx.Client) -> int:
    return int(admin.get("/v1/templates/base").json()["pool"]["ready"])


def test_a_worker_killed_while_handing_over_a_member_loses_nothing(
    platform: Platform, worker: Service, pool_of_one: httpx.Client
) -> None:
    with platform.client() as c, restarted(worker, SPACE_CRASH_AT="claim.after-identity"):
        # The restarted worker listening again and its member ready (a slow restart can cost
        # it: a claim sent to a worker not yet listening drops its member).
        until(lambda: listening(worker), 60)
        # Shown active too: a restart slower than its heartbeat shows it lost, and the create
        # is then refused at once (503) rather than claimed.
        shown_active(platform, platform.worker_id)
        until(lambda: _members(pool_of_one) == 1, 90)
        r = c.post("/v1/sandboxes", params={"wait": "false"}, json={})
        assert r.status_code in (201, 202), r.text  # the claim failed: a create instead
        sid = r.json()["id"]
        until(lambda: _died(worker), 30, why=lambda: f"{r.text}\n{platform.logs()}")
    with platform.client() as c:
        converged = until(lambda: _state(c, sid) == "running", 90, step=0.2)
        record("worker killed at claim.after-identity", "the create served by a restore",
               CONVERGE_S, converged)  # fmt: skip
        assert run(c, sid, "echo ok")[0] == b"ok\n"
        c.delete(f"/v1/sandboxes/{sid}")
    until(lambda: _members(pool_of_one) == 1, 60)


@pytest.mark.parametrize("step", ["claim.after-record", "claim.after-worker"])
def test_an_api_killed_mid_claim_hands_nothing_half_over(
    platform: Platform, pool_of_one: httpx.Client, step: str
) -> None:
    with platform.client() as c:
        mine = _live_ids(c)
    with restarted(platform.api, SPACE_CRASH_AT=step):
        platform.wait_api()
        with platform.client() as c, pytest.raises(httpx.TransportError):
            c.post("/v1/sandboxes", json={})
        until(lambda: _died(platform.api), 10)
    platform.wait_api()
    with platform.client() as c:
        # The member that was being claimed is nobody's: never in the tenant's list, dropped
        # once its claim is given up, and the pool is refilled.
        assert _live_ids(c) == mine
        refilled = until(lambda: _members(pool_of_one) == 1, 90, step=0.2)
        record(f"API killed at {step}", "the claim dropped and the pool refilled",
               CONVERGE_S, refilled)  # fmt: skip
        sb = create(c)
        assert sb["state"] == "running" and sb["boot"] == "pool", sb
        wait_state(c, sb["id"], "running")
        c.delete(f"/v1/sandboxes/{sb['id']}")


@pytest.mark.parametrize("step", ["template.after-stage", "template.after-base"])
def test_a_worker_killed_while_making_a_template_of_a_checkpoint_puts_nothing_in_use(
    platform: Platform, worker: Service, step: str
) -> None:
    """The template is used only once it is whole: a build that dies leaves it unused (or, if
    the controller's call never got its answer, started again and finished), and another build
    makes it."""
    name = f"crash-{step.split('-')[-1]}"
    with platform.client(platform.admin_key) as admin:
        sid = create(admin)["id"]
        pid = start_counter(admin, sid)
        run(admin, sid, "echo kept > /root/kept && sync")
        ck = admin.post(f"/v1/sandboxes/{sid}/checkpoints", json={}).json()
        body = {"checkpoint": {"sandbox_id": sid, "checkpoint_id": ck["id"]}}

        def built() -> dict[str, object]:
            return dict(admin.get(f"/v1/templates/{name}").json())

        with restarted(worker, SPACE_CRASH_AT=step):
            until(lambda: listening(worker), 60)
            shown_active(platform, platform.worker_id)
            until(lambda: _state(admin, sid) == "running", 30, why=lambda: _state(admin, sid))
            assert admin.post(f"/v1/templates/{name}/builds", json=body).status_code == 202
            until(lambda: _died(worker), 60, why=platform.logs)
        ended = until(lambda: built()["state"] in ("failed", "ready"), 60, why=built)
        record(f"worker killed at {step}", "the build failed or done", CONVERGE_S, ended)
        if built()["state"] == "failed":
            assert built()["built"] is None, built()
            r = admin.post("/v1/sandboxes", json={"template": name})
            assert r.status_code == 404, r.text  # nothing half-made is in use
            assert admin.post(f"/v1/templates/{name}/builds", json=body).status_code == 202
            until(lambda: built()["state"] == "ready", 120, why=built)
        kid = create(admin, template=name)["id"]
        assert counter_runs(admin, kid, pid), "the checkpoint's process runs in its sandboxes"
        assert run(admin, kid, "cat /root/kept")[0] == b"kept\n"
        for vm in (kid, sid):
            admin.delete(f"/v1/sandboxes/{vm}")
        until(lambda: admin.delete(f"/v1/templates/{name}").status_code == 200, 60)

"""JSON logs that follow a request: one create's request id (the client's `X-Request-Id`, echoed
back) is on the API's line for it, on the controller's lines for the steps it took, and on the
worker's line for the VM it made, each with the tenant, sandbox and worker."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..stack import Platform

CONTEXT = ("request_id", "tenant", "sandbox", "worker")


def lines(log: Path) -> list[dict[str, Any]]:
    """The service's own lines (its log file also holds what its children print)."""
    found = []
    for text in log.read_text(errors="replace").splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and "service" in line:
            found.append(line)
    return found


def about(
    log: Path, request_id: str, has: Callable[[dict[str, Any]], bool] = lambda _: True,
    timeout: float = 30,
) -> list[dict[str, Any]]:  # fmt: skip
    """The lines of a request, once one of them `has` what the caller looks for (a service
    writes its line for a call after answering it, so it may come after the client's answer)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in lines(log) if x["request_id"] == request_id]
        if any(has(x) for x in found):
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"no such line of request {request_id} in {log}: {found}")
        time.sleep(0.2)


def test_one_create_is_followed_from_the_api_through_the_controller_to_the_worker(
    platform: Platform,
) -> None:
    rid = f"trace-{secrets.token_hex(6)}"
    with platform.client() as c:
        r = c.post("/v1/sandboxes", json={"id": f"logs-{secrets.token_hex(3)}"},
                   headers={"X-Request-Id": rid})  # fmt: skip
        assert r.status_code == 201, r.text
        assert r.headers["x-request-id"] == rid
        sid, wid = r.json()["id"], r.json()["worker_id"]

        api = about(platform.api.log, rid, lambda x: x.get("path") == "/v1/sandboxes")
        controller = about(platform.controller.log, rid, lambda x: "placed on" in x["message"])
        worker = about(platform.workers[wid].log, rid, lambda x: x.get("method") == "PUT")
        for line in api + controller + worker:
            assert set(CONTEXT) <= set(line) and line["level"] and line["message"], line
        assert {x["service"] for x in api} == {"api"}
        assert {x["service"] for x in controller} == {"controller"}
        assert {x["service"] for x in worker} == {"worker"}
        # The API's line for the call, with what it found out while serving it.
        call = next(x for x in api if x.get("path") == "/v1/sandboxes")
        assert (call["method"], call["status"], call["sandbox"], call["worker"]) == (
            "POST", 201, sid, wid
        ), call  # fmt: skip
        tenant = call["tenant"]
        assert tenant
        # The controller placed and started it, for that request.
        assert any("placed on worker" in x["message"] for x in controller), controller
        assert all((x["tenant"], x["sandbox"]) == (tenant, sid) for x in controller), controller
        assert any(x["worker"] == wid for x in controller)
        # The worker made its VM, for that request, and knew whose it was.
        made = next(x for x in worker if x.get("method") == "PUT")
        assert (made["path"], made["status"]) == (f"/vms/{sid}", 200), made
        assert (made["tenant"], made["sandbox"], made["worker"]) == (tenant, sid, wid), made

        # A delete is a request of its own, followed the same way; an id the client did not
        # send, or that is not a sane one, is made up by the API and echoed all the same.
        r = c.delete(f"/v1/sandboxes/{sid}", headers={"X-Request-Id": "x" * 200})
        assert r.status_code == 200, r.text
        made_up = r.headers["x-request-id"]
        assert made_up and made_up != "x" * 200
        about(platform.controller.log, made_up, lambda x: "deleted" in x["message"])
        about(platform.workers[wid].log, made_up, lambda x: x.get("method") == "DELETE")
        assert c.get("/healthz").headers["x-request-id"]

    # Every line of ours names its context, null where there is none.
    for log in (platform.api.log, platform.controller.log, platform.workers[wid].log):
        assert all(set(CONTEXT) <= set(x) for x in lines(log)), log

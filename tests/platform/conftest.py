"""Fixtures of the platform tests beyond the platform itself."""

from __future__ import annotations

import time

import pytest

import space.interpreter
from space.e2b.rest import MEMORY_MIB

from ..stack import Platform
from .helpers import create, wait_state


@pytest.fixture(scope="session")
def code_interpreter(platform: Platform) -> str:
    """The `code-interpreter` template as SPACE ships it (`space up` builds it the same way):
    its image made at set-up (`space image code-interpreter`), its spec from the package."""
    name = "code-interpreter"
    with platform.client(platform.admin_key) as admin:
        spec = space.interpreter.SPEC.read_text()
        r = admin.post(f"/v1/templates/{name}/builds", json={"spec": spec})
        assert r.status_code == 202, r.text
        with admin.stream("GET", f"/v1/templates/{name}/build/log") as log:
            text = "".join(log.iter_text())
        deadline = time.monotonic() + 120
        while (tpl := admin.get(f"/v1/templates/{name}").json())["state"] == "building":
            assert time.monotonic() < deadline, tpl
            time.sleep(0.2)
        assert tpl["state"] == "ready", (tpl, text)
    # Its first sandbox boots it cold and starts the kernel (about two minutes under TCG here)
    # to make the snapshot the next ones restore: made once, with time for it, so that each
    # test's SDK call (whose own timeout is shorter) is a restore.
    with platform.client() as c:
        first = create(c, template=name, memory_mib=MEMORY_MIB[name])["id"]  # as E2B's SDK gets
        try:
            wait_state(c, first, "running", timeout=300)
        finally:
            assert c.delete(f"/v1/sandboxes/{first}").status_code in (200, 202, 204)
    return name

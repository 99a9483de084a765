"""Fixtures of the platform tests beyond the platform itself."""

from __future__ import annotations

import time

import pytest

import space.interpreter

from ..stack import Platform


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
    return name

"""E2B's template builder, unmodified (`e2b.Template`), against SPACE: the SDK's documented
examples build a template of the admin key's tenant (files uploaded for its COPY steps, a
private image, a start command with a ready check, a Dockerfile parsed by the SDK), sandboxes
of it run, and no other tenant sees it. A tenant's key builds nothing; bad builds fail with the
SDK's own exception and the reason."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException, SandboxException

from tests.templates.conftest import PASSWORD, USER
from tests.templates.conftest import private_registry as private_registry  # a fixture

from ..stack import Platform
from .test_e2b import opts
from .test_templates import image as image  # a fixture

pytestmark = pytest.mark.vm

READY = "python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000\")'"


def forget(platform: Platform, *template_ids: str) -> None:
    """Templates a test made, deleted through SPACE's own API (the session's platform lives on)."""
    with platform.client(platform.admin_key) as admin:
        for template_id in template_ids:
            assert admin.delete(f"/v1/templates/{template_id}").status_code in (200, 404)


def api(platform: Platform, key: str | None = None) -> dict[str, Any]:
    """Builds take an admin key, as SPACE's own do."""
    return {"api_key": key or platform.admin_key, "api_url": f"{platform.api_url}/e2b"}


def test_a_template_built_by_the_sdk_runs_and_is_its_tenants_alone(
    platform: Platform, image: str, tmp_path: Path
) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app/hello.txt").write_text("copied by the sdk\n")
    (tmp_path / "app/debug.log").write_text("left out\n")
    once = secrets.randbelow(10**9)  # a step of its own each run: the step cache outlives it
    template = (
        Template(file_context_path=tmp_path, file_ignore_patterns=["**/*.log"])
        .from_image(image, username=USER, password=PASSWORD)
        .copy("app", "/opt/app/", user="nobody", mode=0o640)
        .set_envs({"MODE": "e2b"})
        .set_workdir("/opt/app")
        .run_cmd(f"echo built {once} | tee /opt/app/built.txt", user="root")
        .set_start_cmd("python3 -m http.server 8000", READY)
    )
    logs: list[str] = []
    info = Template.build(template, "sdk-built", on_build_logs=lambda e: logs.append(e.message),
                          **api(platform))  # fmt: skip
    with platform.client(platform.admin_key) as admin:  # the admin key's tenant's own
        assert admin.get(f"/v1/templates/{info.template_id}").json()["state"] == "ready"
    with platform.client(platform.key_b) as other:
        assert other.get(f"/v1/templates/{info.template_id}").status_code == 404
    assert any(f"built {once}" in line for line in logs), logs
    assert Template.exists("sdk-built", **api(platform))
    assert not Template.exists("sdk-built", **api(platform, platform.key_b))

    sbx = Sandbox.create("sdk-built", timeout=600, **opts(platform, platform.admin_key))
    try:
        r = sbx.commands.run("cat hello.txt built.txt; ls; echo $MODE; stat -c '%U %a' hello.txt",
                             cwd="/opt/app")  # fmt: skip
        assert r.stdout == f"copied by the sdk\nbuilt {once}\nbuilt.txt\nhello.txt\ne2b\n" \
                           "nobody 640\n", r.stdout  # fmt: skip
        # The start command runs, and was ready before the create answered.
        assert sbx.commands.run(READY).exit_code == 0
    finally:
        sbx.kill()
    with pytest.raises(SandboxException):
        Sandbox.create("sdk-built", **opts(platform, platform.key_b))
    forget(platform, info.template_id)


def test_a_dockerfile_the_sdk_parses_builds(platform: Platform, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("from the dockerfile's context\n")
    dockerfile = """\
FROM e2bdev/base
ENV GREETING=docker
COPY notes.txt /srv/notes.txt
RUN echo "$GREETING" > /srv/greeting
WORKDIR /srv
USER root
"""
    template = Template(file_context_path=tmp_path).from_dockerfile(dockerfile)
    info = Template.build(template, "sdk-dockerfile", **api(platform))
    sbx = Sandbox.create("sdk-dockerfile", timeout=600, **opts(platform, platform.admin_key))
    try:
        r = sbx.commands.run("cat /srv/notes.txt /srv/greeting")
        assert r.stdout == "from the dockerfile's context\ndocker\n", r.stdout
    finally:
        sbx.kill()
    forget(platform, info.template_id)


def test_builds_that_cannot_be_are_refused_with_the_reason(platform: Platform) -> None:
    with pytest.raises(BuildException, match="admin key"):
        Template.build(Template().from_template("base"), "mine", **api(platform, platform.key_a))
    failing = Template().from_template("base").run_cmd("echo boom >&2; exit 3")
    with pytest.raises(BuildException, match="exit code 3"):
        Template.build(failing, "sdk-failing", **api(platform))
    with pytest.raises(BuildException, match="tags are not supported"):
        Template.build(Template().from_template("base"), "sdk-tagged:v1", **api(platform))
    with pytest.raises(BuildException, match="fromTemplate 'other'"):
        Template.build(Template().from_template("other"), "sdk-other", **api(platform))

    base = f"{platform.api_url}/e2b"
    with httpx.Client(base_url=base, headers={"X-API-KEY": platform.admin_key}) as c:
        made = c.post("/v3/templates", json={"name": "sdk-raw"}).json()
        tid = made["templateID"]
        # Another tenant's template id is not found; a files hash is 64 hex digits.
        other = c.get(f"/templates/{tid}x/files/{'0' * 64}")
        assert other.status_code == 404 and other.json()["message"], other.text
        assert c.get(f"/templates/{tid}/files/nothex").status_code == 400
        asked = c.get(f"/templates/{tid}/files/{'a' * 64}").json()
        assert asked["present"] is False
        # The upload URL's token is its authority: another token is refused, and a COPY whose
        # files never came is refused when the build starts.
        forged = asked["url"].replace("token=", "token=x")
        assert httpx.put(forged, content=b"x").status_code == 403
        step = {"type": "COPY", "args": ["a", "/a"], "filesHash": "b" * 64}
        start = c.post(f"/v2/templates/{tid}/builds/{made['buildID']}",
                       json={"fromTemplate": "base", "steps": [step]})  # fmt: skip
        assert start.status_code == 400 and "were not uploaded" in start.json()["message"]
        bad = {"fromTemplate": "base", "steps": [{"type": "HEALTHCHECK", "args": ["x"]}]}
        start = c.post(f"/v2/templates/{tid}/builds/{made['buildID']}", json=bad)
        assert start.status_code == 400 and "RUN, COPY" in start.json()["message"], start.text
        failed = c.get("/templates/aliases/sdk-failing")  # its first build failed: none to use
        assert failed.status_code == 404, failed.text
    forget(platform, tid, tid.replace("sdk-raw", "sdk-failing"))

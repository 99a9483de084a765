"""Templates through the API: built on a worker from a private OCI image (the credentials are
needed and used), cached step by step, restored from a base snapshot with the image's own
command running, refused when in use, and clear about every bad request."""

from __future__ import annotations

import base64
import io
import json
import secrets
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from space.worker.images.base import base_root, ensure_base_template
from tests.templates.conftest import PASSWORD, USER, Registry
from tests.templates.conftest import private_registry as private_registry  # a fixture
from tests.templates.helpers import LAYER_TYPES, Image, compress, file, tar_bytes

from ..stack import Platform
from .helpers import create, run

POOL = Path("/var/lib/space/pool")
HELLO = '#!/bin/sh\necho "hello $1 from $GREETING in $(pwd)"\nexec sleep infinity\n'
CREDENTIALS = {"REG_USER": USER, "REG_PASS": PASSWORD}


@pytest.fixture(scope="module")
def image(private_registry: Registry) -> str:
    """The base Debian root plus an entrypoint that greets and stays up, pushed privately."""
    base = ensure_base_template()
    manifest = json.loads((base_root() / base.key / "manifest.json").read_text())
    root = Path(manifest["stage1_tarball"]).read_bytes()
    hello = compress(tar_bytes([file("usr/local/bin/hello", HELLO, mode=0o755)]), "gzip")
    img = Image(
        layers=[(root, LAYER_TYPES["zstd"]), (hello, LAYER_TYPES["gzip"])],
        config={
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=oci"],
            "Entrypoint": ["/usr/local/bin/hello"],
            "Cmd": ["world"],
            "WorkingDir": "/srv",
        },
    )
    private_registry.pusher.push("private/hello", "1", img)
    return f"{private_registry.host}/private/hello:1"


def spec(image: str, step: str, name: str = "hello") -> str:
    return f"""
[template]
name = "{name}"
from = "oci://{image}"
insecure = true
ready = "test -s /var/log/space-start.log"

[template.registry]
username_env = "REG_USER"
password_env = "REG_PASS"

[[steps]]
copy = {{ src = "files/", dst = "/opt/files" }}

[[steps]]
run = "{step}"
"""


def context() -> str:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = b"from the build context\n"
        info = tarfile.TarInfo("files/note.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def big_context() -> str:
    """A build context of 3 MiB that does not compress."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        data = secrets.token_bytes(3 << 20)
        info = tarfile.TarInfo("blob.bin")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return base64.b64encode(buf.getvalue()).decode()


def build(admin: httpx.Client, name: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Start a build, follow its log to the end; the template as it then is, and the log."""
    r = admin.post(f"/v1/templates/{name}/builds", json=body)
    assert r.status_code == 202, r.text
    assert r.json()["state"] == "building"
    with admin.stream("GET", f"/v1/templates/{name}/build/log") as log:
        assert log.status_code == 200
        text = "".join(log.iter_text())
    deadline = time.monotonic() + 30
    while (tpl := admin.get(f"/v1/templates/{name}").json())["state"] == "building":
        assert time.monotonic() < deadline, tpl
        time.sleep(0.2)
    return tpl, text


def console(platform: Platform, sandbox_id: str) -> str:
    (log,) = [POOL / "workers" / w / "vms" / sandbox_id / "console.log" for w in platform.workers
              if (POOL / "workers" / w / "vms" / sandbox_id).exists()]  # fmt: skip
    return log.read_text(errors="replace")


def test_a_private_image_becomes_a_template_with_a_base_snapshot(
    platform: Platform, image: str
) -> None:
    with platform.client(platform.admin_key) as admin, platform.client() as c:
        one = f"one-{secrets.token_hex(4)}"  # new each run: the pool's step cache outlives it
        body = {"spec": spec(image, f"echo {one} > /etc/step"), "context": context(),
                "environ": CREDENTIALS}  # fmt: skip
        tpl, log = build(admin, "hello", body)
        assert tpl["state"] == "ready", (tpl, log)
        built = tpl["built"]
        assert built["entrypoint"] == ["/usr/local/bin/hello"] and built["workdir"] == "/srv"
        assert f"step 2: run: echo {one} > /etc/step" in log

        # The first sandbox makes the base snapshot (the image's command started and ready);
        # the next is restored from it: its console never saw a boot.
        first = create(c, template="hello")
        second = create(c, template="hello")
        assert (first["state"], second["state"]) == ("running", "running"), (first, second)
        assert second["boot"] == "restore"
        assert "space-init" not in console(platform, second["id"])
        out, _, _ = run(c, second["id"], "cat /var/log/space-start.log /etc/step /opt/files/*")
        assert out.decode().splitlines() == [
            "hello world from oci in /srv", one, "from the build context",
        ]  # fmt: skip
        out, _, _ = run(c, second["id"], "pwd; echo $GREETING; pgrep -f /usr/local/bin/hello")
        assert out.decode().split()[:2] == ["/srv", "oci"] and out.split()[2].isdigit()

        # Changing the last step rebuilds only that step.
        two = f"two-{secrets.token_hex(4)}"
        body["spec"] = spec(image, f"echo {two} > /etc/step")
        started = time.monotonic()
        tpl, log = build(admin, "hello", body)
        assert tpl["state"] == "ready", (tpl, log)
        assert "source: cached" in log and "step 1: cached" in log, log
        assert "step 2: cached" not in log
        assert tpl["built"]["digest"] != built["digest"]
        assert time.monotonic() - started < tpl["built"]["build_seconds"] + built["build_seconds"]
        third = create(c, template="hello")
        assert run(c, third["id"], "cat /etc/step")[0] == f"{two}\n".encode()

        # In use, it stays; once its sandboxes are gone, it goes.
        r = admin.delete("/v1/templates/hello")
        assert r.status_code == 409 and first["id"] in r.json()["detail"], r.text
        for sb in (first, second, third):
            c.delete(f"/v1/sandboxes/{sb['id']}")
        assert admin.delete("/v1/templates/hello").json()["state"] == "deleting"
        deadline = time.monotonic() + 30
        while admin.get("/v1/templates/hello").status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert not list(POOL.glob("templates/hello/*/rootfs.ext4"))
        r = c.post("/v1/sandboxes", json={"template": "hello"})
        assert r.status_code == 404


def test_builds_fail_clearly(platform: Platform, image: str) -> None:
    with platform.client(platform.admin_key) as admin, platform.client() as c:
        good = {"spec": spec(image, "true", "bad"), "context": context(),
                "environ": CREDENTIALS}  # fmt: skip
        # Wrong credentials, and an image that is not there: the build fails and says why.
        tpl, log = build(admin, "bad", {**good, "environ": {**CREDENTIALS, "REG_PASS": "nope"}})
        assert tpl["state"] == "failed" and "credentials" in tpl["error"], tpl
        assert tpl["built"] is None and "build failed" in log
        missing = {**good, "spec": spec(image.replace(":1", ":nope"), "true", "bad")}
        tpl, _ = build(admin, "bad", missing)
        assert tpl["state"] == "failed" and "not found" in tpl["error"], tpl
        # A failed template cannot be used, and left nothing on disk.
        assert c.post("/v1/sandboxes", json={"template": "bad"}).status_code == 404
        assert not list(POOL.glob("templates/bad/*"))
        # A step that fails: its exit code and output.
        failing = spec(image, "echo boom >&2; exit 3", "bad")
        tpl, log = build(admin, "bad", {**good, "spec": failing})
        assert tpl["state"] == "failed" and "3" in tpl["error"] and "boom" in log, (tpl, log)

        for name, body, status in (
            ("bad", {**good, "spec": "[template]\nname = 'bad'\n"}, 400),  # no `from`
            ("bad", {**good, "spec": "not toml ["}, 400),
            ("other", good, 400),  # the spec builds "bad", not "other"
            ("bad", {**good, "context": "%%%"}, 400),
            ("bad", {**good, "context": base64.b64encode(b"not a tar").decode()}, 400),
            ("Bad Name", good, 400),
            ("base", good, 409),
            ("bad", {**good, "extra": 1}, 422),
            # A Dockerfile: what SPACE cannot build is refused with its line, before a build.
            ("bad", {"dockerfile": "FROM space:base\nVOLUME /data\n"}, 400),
            ("bad", {"dockerfile": "FROM a\nFROM b\n"}, 400),
            ("bad", {"dockerfile": "RUN true\n"}, 400),
            ("bad", {"dockerfile": "FROM space:base\n", "spec": good["spec"]}, 422),
            ("bad", {**good, "build_args": {"A": "1"}}, 422),
        ):
            r = admin.post(f"/v1/templates/{name}/builds", json=body)
            assert r.status_code == status, (name, body.get("spec"), r.text[:500])
            assert r.json()["detail"]
        # A context past the 1 MiB of other bodies reaches the worker, which finds no source
        # of that name in it.
        body = {"dockerfile": "FROM space:base\nCOPY missing /x\n", "context": big_context()}
        r = admin.post("/v1/templates/bad/builds", json=body)
        assert r.status_code == 400 and "'missing' does not exist" in r.text, r.text[:500]
        r = c.post("/v1/templates/bad/builds", json=good)  # not an admin key
        assert r.status_code == 403
        assert c.delete("/v1/templates/bad").status_code == 403
        assert admin.delete("/v1/templates/base").status_code == 409
        assert admin.delete("/v1/templates/bad").status_code == 200


def test_the_cli_builds_through_the_api_with_progress(platform: Platform, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/python3").write_text("#!/bin/false\n")  # enough for the static check
    (tree / "usr/bin/python3").chmod(0o755)
    (tmp_path / "space.toml").write_text(
        '[template]\nname = "clidemo"\nfrom = "dir:tree"\n[[steps]]\nenv = { MODE = "cli" }\n'
    )
    argv = [sys.executable, "-m", "space.cli.main", "template", "build", "-f",
            str(tmp_path / "space.toml"), "--api-url", platform.api_url,
            "--api-key", platform.admin_key]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 1: env: MODE=cli" in r.stdout and "built clidemo" in r.stdout, r.stdout
    with platform.client(platform.admin_key) as admin:
        tpl = admin.get("/v1/templates/clidemo").json()
        assert tpl["state"] == "ready" and tpl["built"]["env"]["MODE"] == "cli"
        assert admin.delete("/v1/templates/clidemo").status_code == 200
    # Not an admin key: one clear line, no traceback.
    argv[-1] = platform.key_a
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1 and "admin" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_dockerfile_builds_through_the_cli_and_its_runs_pass_the_gateway(
    platform: Platform, tmp_path: Path
) -> None:
    """A RUN downloads (here from the test internet), as `apt-get install` would, and cannot
    reach what no sandbox may (a stand-in metadata service of the test's own); COPY takes the
    context less its .dockerignore, and ARGs come from --build-arg."""
    fetch = (
        "import sys, urllib.request as u\n"
        "try: print(sys.argv[1], u.urlopen(sys.argv[1], timeout=10).read().decode())\n"
        "except Exception as e: print(sys.argv[1], 'refused:', type(e).__name__)\n"
    )
    (tmp_path / "fetch.py").write_text(fetch)
    (tmp_path / "secret.env").write_text("TOKEN=never-sent\n")
    (tmp_path / ".dockerignore").write_text("*.env\n")
    # New each run: the pool's step cache outlives it, and a cached step would not run.
    once = secrets.randbelow(10**9)
    (tmp_path / "Dockerfile").write_text("""\
FROM space:base
ARG RUN_ID
COPY . /opt/ctx/
RUN python3 /opt/ctx/fetch.py http://allowed.test/ && echo run $RUN_ID
RUN python3 /opt/ctx/fetch.py http://169.254.169.254/ && ls -A /opt/ctx | sed 's/^/ctx: /'
CMD ["sleep", "infinity"]
""")
    argv = [sys.executable, "-m", "space.cli.main", "template", "build", "-f",
            str(tmp_path / "Dockerfile"), "--name", "fetched", "--build-arg", f"RUN_ID={once}",
            "--api-url", platform.api_url, "--api-key", platform.admin_key]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    log = r.stdout
    assert "hello from allowed.test" in log and f"run {once}" in log, log
    assert "http://169.254.169.254/ refused" in log, log
    assert "ctx: .dockerignore" in log and "ctx: fetch.py" in log, log
    assert "secret.env" not in log, log
    with platform.client(platform.admin_key) as admin:
        tpl = admin.get("/v1/templates/fetched").json()
        assert tpl["state"] == "ready" and tpl["built"]["start"] == "sleep infinity", tpl
        assert admin.delete("/v1/templates/fetched").status_code == 200

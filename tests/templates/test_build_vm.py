"""Template builds in real build VMs: an OCI image from the local registry, step caching.

The image is the `base` template's own Debian root (its mmdebstrap tarball, a zstd layer) plus
a layer with an entrypoint script, pushed to a local docker-registry by the test itself.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from space.worker.images.base import base_root, ensure_base_template
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import BootImages, Machine
from space.worker.templates import (
    BuildEnv,
    BuildError,
    BuildLog,
    build_template,
    list_templates,
    remove_template,
)
from space.worker.templates.dockerfile import dockerfile_spec
from space.worker.templates.errors import (
    AuthenticationFailed,
    ImageNotFound,
    NotBootable,
    SpecError,
)
from space.worker.templates.spec import parse_spec
from tests.templates.conftest import PASSWORD, USER, Registry
from tests.templates.helpers import LAYER_TYPES, Image, compress, file, tar_bytes

pytestmark = pytest.mark.vm

HELLO = '#!/bin/sh\necho "hello $1 from $GREETING in $(pwd)"\n'


def build_vmm_pids(under: Path) -> set[int]:
    """QEMU processes of build VMs (named space-build-*) whose run directory is under `under`.

    Scoped to the test's own build root: other builds may run on this host meanwhile."""
    pids = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            ours = cmdline.startswith(b"qemu-system") and b"\0-name\0space-build-" in cmdline
            if ours and f"{under}/".encode() in cmdline:
                pids.add(int(proc.name))
    return pids


@pytest.fixture(scope="module")
async def runtime() -> LocalRuntime:
    return await local_runtime()


@pytest.fixture(scope="module")
def build_root(runtime: LocalRuntime) -> Iterator[Path]:
    # In the pool: build caches and templates are reflinks of each other.
    root = runtime.pool.root / "test-templates" / uuid.uuid4().hex[:8]
    root.mkdir(parents=True)
    yield root
    shutil.rmtree(root)


@pytest.fixture(scope="module")
def env(runtime: LocalRuntime, build_root: Path) -> BuildEnv:
    return BuildEnv.from_runtime(runtime, build_root)


@pytest.fixture(scope="module")
def debian_hello() -> Image:
    """The base Debian root (its mmdebstrap tarball as a zstd layer) + an entrypoint layer."""
    base = ensure_base_template()
    manifest = json.loads((base_root() / base.key / "manifest.json").read_text())
    tarball = Path(manifest["stage1_tarball"])
    hello = compress(tar_bytes([file("usr/local/bin/hello", HELLO, mode=0o755)]), "gzip")
    return Image(
        layers=[(tarball.read_bytes(), LAYER_TYPES["zstd"]), (hello, LAYER_TYPES["gzip"])],
        config={
            "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=oci"],
            "Entrypoint": ["/usr/local/bin/hello"],
            "Cmd": ["world"],
            "WorkingDir": "/srv",
        },
    )


@pytest.fixture(scope="module")
def debian_image(registry: Registry, debian_hello: Image) -> str:
    registry.pusher.push("space/debian-hello", "1", debian_hello)
    return f"{registry.host}/space/debian-hello:1"


@pytest.fixture(scope="module")
def private_debian_image(private_registry: Registry, debian_hello: Image) -> str:
    private_registry.pusher.push("private/debian-hello", "1", debian_hello)
    return f"{private_registry.host}/private/debian-hello:1"


async def boot(runtime: LocalRuntime, rootfs: Path) -> AsyncIterator[Machine]:
    images = BootImages(runtime.images.kernel, runtime.images.initrd, rootfs)
    m = await Machine.boot(runtime.driver, runtime.pool, images)
    try:
        yield m
    finally:
        await m.close()


def spec_text(image: str, last_step: str) -> str:
    return f"""
[template]
name = "hello"
from = "oci://{image}"
insecure = true
start = "sleep infinity"
ready = "true"

[template.registry]
username_env = "TEST_REGISTRY_USER"
password_env = "TEST_REGISTRY_PASSWORD"

[[steps]]
run = "echo step-one > /etc/marker"

[[steps]]
copy = {{ src = "files/", dst = "/opt/files" }}

[[steps]]
run = "{last_step}"
"""


async def test_oci_template_runs_its_entrypoint_and_steps_are_cached(
    runtime: LocalRuntime, env: BuildEnv, private_debian_image: str, tmp_path: Path
) -> None:
    """From a private registry: the spec names the variables that hold the credentials."""
    (tmp_path / "files").mkdir()
    (tmp_path / "files/a.txt").write_text("copied\n")
    creds = {"TEST_REGISTRY_USER": USER, "TEST_REGISTRY_PASSWORD": PASSWORD}
    spec = parse_spec(spec_text(private_debian_image, "echo v1 >> /etc/marker"), tmp_path)
    with pytest.raises(SpecError, match="TEST_REGISTRY_PASSWORD"):
        await build_template(spec, env, print, environ={"TEST_REGISTRY_USER": USER})
    wrong = {**creds, "TEST_REGISTRY_PASSWORD": "wrong"}
    with pytest.raises(AuthenticationFailed, match="refused the credentials"):
        await build_template(spec, env, print, environ=wrong)

    lines: list[str] = []
    first = await build_template(spec, env, lines.append, environ=creds)
    assert first.command == ["/usr/local/bin/hello", "world"]
    assert (first.workdir, first.env["GREETING"], first.start) == ("/srv", "oci", "sleep infinity")
    assert (first.path / "template.json").is_file() and first.rootfs.stat().st_mode & 0o222 == 0
    assert not any("cached" in line for line in lines), lines
    # One build VM for the three steps, each step's disk kept while it went on.
    assert sum("build VM: booted" in line for line in lines) == 1, lines
    assert sum("disk kept" in line for line in lines) == 2, lines
    assert sum("sealed and stopped" in line for line in lines) == 1, lines
    for entry in env.cache.iterdir():  # every stage a whole, clean ext4
        if not entry.name.startswith("."):
            fsck = await asyncio.to_thread(
                subprocess.run, ["e2fsck", "-f", "-n", entry / "rootfs.ext4"],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            assert fsck.returncode == 0, (entry, fsck.stdout, fsck.stderr)

    async for m in boot(runtime, first.rootfs):
        r = await m.agent.run(first.command, env=first.env, cwd="/")
        assert r.stdout.decode() == "hello world from oci in /\n", r
        assert (await m.agent.read_file("/etc/marker")) == b"step-one\nv1\n"
        assert (await m.agent.read_file("/opt/files/a.txt")) == b"copied\n"

    # Step 3 changed: the source and steps 1-2 come from the cache.
    lines.clear()
    spec = parse_spec(spec_text(private_debian_image, "echo v2 >> /etc/marker"), tmp_path)
    second = await build_template(spec, env, lines.append, environ=creds)
    log = "\n".join(lines)
    assert "source: cached" in log and "step 1: cached" in log and "step 2: cached" in log, log
    assert "step 3: cached" not in log, log
    assert second.digest != first.digest
    assert sum("done in" in line for line in lines) == 1, lines  # step 3 alone ran
    async for m in boot(runtime, second.rootfs):  # from step 2's disk, kept as it went on
        assert (await m.agent.read_file("/etc/marker")) == b"step-one\nv2\n"
        assert (await m.agent.read_file("/opt/files/a.txt")) == b"copied\n"

    # A changed copied file invalidates its step and the ones after it.
    (tmp_path / "files/a.txt").write_text("changed\n")
    lines.clear()
    await build_template(spec, env, lines.append, environ=creds)
    log = "\n".join(lines)
    assert "step 1: cached" in log and "step 2: cached" not in log, log

    names = [(r.name, r.digest) for r in list_templates(env.root)]
    assert ("hello", first.digest) in names and ("hello", second.digest) in names
    assert [r.digest for r in remove_template(env.root, "hello", first.digest)] == [first.digest]
    names = [(r.name, r.digest) for r in list_templates(env.root)]
    assert ("hello", first.digest) not in names and ("hello", second.digest) in names


async def test_failed_step_leaves_nothing_behind(env: BuildEnv, debian_image: str) -> None:
    before = sorted(p.name for p in env.cache.iterdir()) if env.cache.exists() else []
    spec = parse_spec(
        f"""
[template]
name = "broken"
from = "oci://{debian_image}"
insecure = true
[[steps]]
run = "echo partial > /partial; echo about to fail; exit 3"
""",
        Path("/"),
    )
    lines: list[str] = []
    with pytest.raises(BuildError, match=r"step 1 \(run: .*\) failed with exit code 3"):
        await build_template(spec, env, lines.append)
    assert "  | about to fail" in lines
    after = sorted(p.name for p in env.cache.iterdir())
    # Only the source stage is new (it is complete and reusable); no temporary directories.
    assert not [n for n in after if n.startswith(".tmp")]
    assert len(set(after) - set(before)) <= 1
    assert not (env.templates / "broken").exists() or not list((env.templates / "broken").iterdir())
    assert build_vmm_pids(env.build_vms) == set()
    assert list(env.build_vms.iterdir()) == []


async def test_what_a_step_leaves_running_ends_with_it(
    runtime: LocalRuntime, env: BuildEnv, debian_image: str
) -> None:
    """Steps share a build VM: a daemon a step leaves is killed before its disk is kept, so it
    neither writes on into the copy nor runs in the next step (a rebuild from the cache would
    not have it either)."""
    daemon = "while :; do date >> /var/tmp/ticks; sleep 0.05; done"
    start = f"nohup sh -c '{daemon}' >/dev/null 2>&1 & echo $! > /var/tmp/pid; sleep 0.5"
    ticks = "wc -l < /var/tmp/ticks"
    gone = f"! kill -0 $(cat /var/tmp/pid) && n=$({ticks}) && sleep 1 && test $({ticks}) = $n"
    spec = parse_spec(
        f"""
[template]
name = "daemon-{uuid.uuid4().hex[:8]}"
from = "oci://{debian_image}"
insecure = true
[[steps]]
run = "{start}"
[[steps]]
run = "{gone}"
""",
        Path("/"),
    )
    record = await build_template(spec, env, print)
    async for m in boot(runtime, record.rootfs):
        assert int((await m.agent.run(["wc", "-l", "/var/tmp/ticks"])).stdout.split()[0]) > 0


async def test_a_step_that_freezes_the_root_fails_clearly(env: BuildEnv, debian_image: str) -> None:
    freeze = "import fcntl, os; fcntl.ioctl(os.open(chr(47), 0), 0xC0045877, 0)"  # FIFREEZE /
    spec = parse_spec(
        f"""
[template]
name = "frozen"
from = "oci://{debian_image}"
insecure = true
[[steps]]
run = "python3 -c '{freeze}' # {uuid.uuid4().hex}"
[[steps]]
run = "true"
""",
        Path("/"),
    )
    with pytest.raises(BuildError, match=r"step 1: the build VM could not keep its disk"):
        await build_template(spec, env, print)
    assert build_vmm_pids(env.build_vms) == set()
    assert not [p for p in env.cache.iterdir() if p.name.startswith(".tmp")]


async def test_cancelled_build_leaves_nothing_behind(env: BuildEnv, debian_image: str) -> None:
    spec = parse_spec(
        f"""
[template]
name = "cancelled"
from = "oci://{debian_image}"
insecure = true
[[steps]]
run = "echo started; sleep 120"
""",
        Path("/"),
    )
    log = BuildLog()
    task = asyncio.ensure_future(build_template(spec, env, log))
    async for line in log.follow():
        if line == "  | started":
            break
    assert build_vmm_pids(env.build_vms), "the build VM should be running now"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert build_vmm_pids(env.build_vms) == set()
    assert list(env.build_vms.iterdir()) == []
    assert not [p for p in env.cache.iterdir() if p.name.startswith(".tmp")]
    assert not (env.templates / "cancelled").exists()


async def test_vms_of_dead_builds_are_reaped(
    runtime: LocalRuntime, env: BuildEnv, registry: Registry
) -> None:
    """A builder killed mid-step leaves its VM running; the next build stops and removes it."""
    dead_pid = 4_000_000  # above any pid this host hands out (pid_max is 4194304 at most)
    images = BootImages(runtime.images.kernel, runtime.images.initrd, runtime.images.rootfs)
    env.build_vms.mkdir(parents=True, exist_ok=True)
    m = await Machine.boot(
        runtime.driver, runtime.pool, images, vm_id=f"build-{dead_pid}-orphan",
        vms_dir=env.build_vms,
    )  # fmt: skip
    await m.detach()
    assert build_vmm_pids(env.build_vms)
    spec = parse_spec(f'[template]\nname = "x"\nfrom = "oci://{registry.host}/space/none:1"\n'
                      "insecure = true\n", Path("/"))  # fmt: skip
    with pytest.raises(ImageNotFound):
        await build_template(spec, env, print)
    deadline = time.monotonic() + 10
    while build_vmm_pids(env.build_vms) and time.monotonic() < deadline:  # noqa: ASYNC110 - SIGKILL takes a moment
        await asyncio.sleep(0.1)
    assert build_vmm_pids(env.build_vms) == set()
    assert list(env.build_vms.iterdir()) == []


async def test_image_without_python_is_refused_before_any_vm(
    env: BuildEnv, registry: Registry
) -> None:
    img = Image(
        layers=[
            (
                compress(tar_bytes([file("bin/sh", "not really", mode=0o755)]), "gzip"),
                LAYER_TYPES["gzip"],
            )
        ],
    )
    registry.pusher.push("space/no-python", "1", img)
    spec = parse_spec(
        f'[template]\nname = "nopy"\nfrom = "oci://{registry.host}/space/no-python:1"\n'
        'insecure = true\n[[steps]]\nrun = "true"\n',
        Path("/"),
    )
    with pytest.raises(NotBootable, match="python3"):
        await build_template(spec, env, print)
    assert not [p for p in env.cache.iterdir() if p.name.startswith(".tmp")]


async def test_a_dockerfile_builds_the_template_it_says(
    runtime: LocalRuntime, env: BuildEnv, debian_image: str, tmp_path: Path
) -> None:
    """Every instruction SPACE takes, built for real: owners and modes of copies, what the
    .dockerignore leaves out, build arguments seen by RUN and not kept, the start command."""
    for name in ("a.py", "b.py", "skip.py", "conf/x.conf", "conf/debug.log", "notes.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"{name}\n")
    (tmp_path / ".dockerignore").write_text("skip.py\n**/*.log\n")
    dockerfile = f"""\
ARG WHO=nobody-said
FROM {debian_image}
ARG WHO
ENV APP=/app
WORKDIR $APP
COPY --chown=nobody:nogroup --chmod=0750 *.py conf ./
COPY notes.txt /etc/notes
COPY --chown=nobody notes.txt /srv/made/here/
RUN echo "built by $WHO in $(pwd)" > who
USER nobody
CMD ["hello", "docker"]
"""
    text = dockerfile_spec(dockerfile, "from-dockerfile", {"WHO": "a build arg"}, insecure=True)
    record = await build_template(parse_spec(text, tmp_path), env, print)
    assert (record.workdir, record.user, record.start) == ("/app", "nobody", "hello docker")
    assert record.env["APP"] == "/app" and "WHO" not in record.env

    async for m in boot(runtime, record.rootfs):
        ls = await m.agent.run(["sh", "-c", "cd /app && stat -c '%n %U:%G %a' * | sort"])
        assert ls.stdout.decode().splitlines() == [
            "a.py nobody:nogroup 750",
            "b.py nobody:nogroup 750",
            "who root:root 644",
            "x.conf nobody:nogroup 750",
        ], ls
        assert await m.agent.read_file("/app/who") == b"built by a build arg in /app\n"
        notes = await m.agent.run(["stat", "-c", "%U %a", "/etc/notes"])
        assert notes.stdout == b"root 644\n", notes
        # The directories a copy had to make are its owner's too; those there already are not.
        made = await m.agent.run(["stat", "-c", "%n %u:%g", "/srv", "/srv/made",
                                  "/srv/made/here", "/srv/made/here/notes.txt"])  # fmt: skip
        assert made.stdout.decode().splitlines() == [
            "/srv 0:0", "/srv/made 65534:65534", "/srv/made/here 65534:65534",
            "/srv/made/here/notes.txt 65534:65534",
        ], made  # fmt: skip

    lines: list[str] = []
    again = await build_template(parse_spec(text, tmp_path), env, lines.append)
    assert again.digest == record.digest
    assert "source: cached" in lines[2] and not any("done in" in line for line in lines), lines
    assert sum(": cached (" in line for line in lines) == 6, lines  # source, steps with a VM
    (tmp_path / "skip.py").write_text("changed, and ignored all the same\n")
    (tmp_path / "conf/debug.log").write_text("changed too\n")
    assert (await build_template(parse_spec(text, tmp_path), env, print)).digest == record.digest

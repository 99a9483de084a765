"""Build a template from a spec: the source as an ext4 image, then each step in a build VM.

Every stage is a cache entry `<root>/template-cache/<key>/rootfs.ext4`, where the key chains a
hash over the source's digest and every step so far (with the contents of the files a `copy`
brings in). A step whose key is cached is not run: its disk is taken as it is, so changing step 5
of 8 runs steps 5-8 only. The steps that change the disk run in one build VM, booted on a
reflink of the last cached disk: after each, every process the step started is killed, and
the guest's root is frozen (flushed, its journal empty) while its disk is kept as the step's
entry (a reflink again), then thawed for the next; after the last, it is sealed (read-only)
and the VM stops. `env` and `user` only change how later processes run, and need no VM. What a
step leaves in memory but not on disk (a mount, a file in the tmpfs /run, a sysctl) is seen by
the steps after it in that VM, and by none that a later build runs from the cache.

The finished template is `<root>/templates/<name>/<digest>/` (rootfs.ext4 + template.json),
made in a temporary directory and renamed into place; a failed or cancelled build removes its
temporary directories and its VM, so nothing half-built is ever left.

`build_template(spec, env, log)` is the one entry point, for the CLI and the API alike; `log`
receives the build's log line by line, always on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from space.gateway.policy import Policy
from space.worker.agent_client import AgentError
from space.worker.local import LocalRuntime
from space.worker.machine import BootImages, Machine
from space.worker.network import GUEST_MAC, Egress
from space.worker.storage.pool import Pool
from space.worker.storage.reflink import clone_file
from space.worker.templates import rootfs
from space.worker.templates.errors import BuildError
from space.worker.templates.record import RECORD_FILE, ROOTFS_FILE, TemplateRecord, agent_user
from space.worker.templates.sources import Source, resolve_source, tree_digest
from space.worker.templates.spec import METADATA_KINDS, Copied, Step, TemplateSpec
from space.worker.vmm.base import Driver, SnapshotInfo
from space.worker.vmm.process import vmm_pids

Log = Callable[[str], None]
# Bump when what a step does to the disk changes in a way its key does not show.
RECIPE = 1
CACHE_DIR = "template-cache"
TEMPLATES_DIR = "templates"
BUILD_VMS_DIR = "build-vms"
# Temporary directories older than this belong to builds that died (live ones last seconds).
STALE_TMP_S = 3600.0
SHUTDOWN_TIMEOUT = 30.0

# Runs in the build VM on the template's python3: unpacks the tar of a copy step from stdin
# into argv[1], owned by argv[2] ("user[:group]", names resolved in the image; a user without
# a group also gives its id as the group's, as Docker's --chown does) if given, with the
# directories it had to make for argv[1].
_UNPACK = """
import grp, os, pwd, sys, tarfile
def ident(name, db, field):
    try:
        return int(name) if name.isdigit() else getattr(db(name), field)
    except KeyError:
        sys.exit(f"chown: no {'user' if db is pwd.getpwnam else 'group'} {name!r} in the image")
owner = sys.argv[2] if len(sys.argv) > 2 else ""
if owner:
    user, _, group = owner.partition(":")
    uid = ident(user, pwd.getpwnam, "pw_uid")
    gid = ident(group, grp.getgrnam, "gr_gid") if group else uid
made, path = [], os.path.abspath(sys.argv[1])
while not os.path.lexists(path):
    made.append(path)
    path = os.path.dirname(path)
os.makedirs(sys.argv[1], exist_ok=True)
kw = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tf:
    for member in tf:
        tf.extract(member, sys.argv[1], **kw)
        if owner:
            os.lchown(os.path.join(sys.argv[1], member.name), uid, gid)
for path in made if owner else ():
    os.lchown(path, uid, gid)
"""


@dataclass(frozen=True)
class BuildEnv:
    """What a build needs of the worker: a VMM driver, the pool, the guest kernel, a root."""

    driver: Driver
    pool: Pool
    kernel: Path
    initrd: Path | None
    root: Path  # holds templates/ and template-cache/; on the pool's file system for reflinks
    # With it, build VMs reach public names through the gateway (run steps can download);
    # without it they have no network.
    egress: Egress | None = None

    @classmethod
    def from_runtime(cls, rt: LocalRuntime, root: Path | None = None) -> BuildEnv:
        return cls(
            driver=rt.driver,
            pool=rt.pool,
            kernel=rt.images.kernel,
            initrd=rt.images.initrd,
            root=root or rt.pool.root,
        )

    @property
    def templates(self) -> Path:
        return self.root / TEMPLATES_DIR

    @property
    def cache(self) -> Path:
        return self.root / CACHE_DIR

    @property
    def build_vms(self) -> Path:
        """Run directories of build VMs: apart from sandboxes, so no worker ever adopts them."""
        return self.root / BUILD_VMS_DIR


@dataclass
class _State:
    """How processes run at this point of the build: the image config changed by steps."""

    env: dict[str, str]
    workdir: str | None
    user: str | None
    descriptions: list[str] = field(default_factory=list)

    def user_arg(self) -> str | int | None:
        return agent_user(self.user)


def _chain(prev: str, part: Mapping[str, Any]) -> str:
    blob = json.dumps(part, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(prev.encode() + b"\n" + blob).hexdigest()


def _thread_safe(log: Log) -> Log:
    """`log` for use from worker threads too: lines are handed to the loop's thread."""
    loop = asyncio.get_running_loop()
    owner = threading.get_ident()

    def emit(line: str) -> None:
        if threading.get_ident() == owner:
            log(line)
        else:
            loop.call_soon_threadsafe(log, line)

    return emit


class _Cache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def get(self, key: str) -> Path | None:
        entry = self.root / key
        if not (entry / "entry.json").is_file():
            return None
        with contextlib.suppress(OSError):
            os.utime(entry / "entry.json")  # last use, for prune_cache
        return entry / ROOTFS_FILE

    def new_tmp(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))

    def publish(self, tmp: Path, key: str, what: str) -> Path:
        (tmp / "entry.json").write_text(
            json.dumps({"key": key, "what": what, "created": time.time()}) + "\n"
        )
        os.chmod(tmp / ROOTFS_FILE, 0o444)  # entries are only ever cloned, never written
        try:
            tmp.rename(self.root / key)
        except OSError:
            # Another build made the same entry meanwhile: identical by its key, keep theirs.
            shutil.rmtree(tmp, ignore_errors=True)
            if self.get(key) is None:
                raise
        return self.root / key / ROOTFS_FILE


async def build_template(
    spec: TemplateSpec,
    env: BuildEnv,
    log: Log,
    *,
    environ: Mapping[str, str] | None = None,
) -> TemplateRecord:
    """Build (or find already built) the template `spec` describes; returns its record."""
    started = time.monotonic()
    log = _thread_safe(log)
    cache = _Cache(env.cache)
    await asyncio.to_thread(_clean_up_after_dead_builds, env)
    log(f"template {spec.name}: from {spec.source}")
    source = await resolve_source(
        spec.source, log, credentials=spec.credentials(environ), insecure=spec.insecure
    )
    key = _chain("", {"recipe": RECIPE, "source": source.digest, "disk_mib": spec.disk_mib})
    disk = cache.get(key)
    if disk is not None:
        log(f"source: cached ({source.digest[:19]})")
    else:
        disk = await _source_stage(source, spec, env, cache, key, log)
    state = _State(dict(source.config.env), source.config.workdir, source.config.user)

    disk_steps = [i for i, step in enumerate(spec.steps, 1) if step.kind not in METADATA_KINDS]
    async with contextlib.AsyncExitStack() as stack:
        vm: Machine | None = None  # booted for the first step not cached, kept to the last
        for i, step in enumerate(spec.steps, 1):
            desc = step.describe()
            state.descriptions.append(desc)
            identity = step.identity()
            if step.kind == "copy":
                assert step.copied is not None
                identity["content"] = await asyncio.to_thread(_copy_digest, step)
            key = _chain(key, identity)
            if step.kind in METADATA_KINDS:
                _apply_metadata(step, state)
                log(f"step {i}: {desc}")
                continue
            # Keys chain: once a step has run, no later one can be cached (a build of the same
            # steps at once publishes entries of the same keys: the first kept wins).
            cached = cache.get(key) if vm is None else None
            if cached is not None:
                log(f"step {i}: cached ({desc})")
                disk = cached
            else:
                log(f"step {i}: {desc}")
                t = time.monotonic()
                if vm is None:
                    vm = await stack.enter_async_context(_build_vm(env, spec, disk, log))
                last = i == disk_steps[-1]
                disk = await _vm_step(vm, env, spec, step, i, state, cache, key, log, last=last)
                log(f"step {i}: done in {time.monotonic() - t:.1f} s")
            if step.kind == "workdir":
                state.workdir = step.value

    config = {
        "env": state.env,
        "workdir": state.workdir,
        "user": state.user,
        "entrypoint": source.config.entrypoint,
        "cmd": source.config.cmd,
        "start": spec.start,
        "ready": spec.ready,
    }
    digest = _chain(key, config)[:16]
    record = TemplateRecord(
        name=spec.name,
        digest=digest,
        path=env.templates / spec.name / digest,
        source=str(spec.source),
        source_digest=source.digest,
        size_bytes=disk.stat().st_size,
        env=state.env,
        workdir=state.workdir,
        user=state.user,
        entrypoint=source.config.entrypoint,
        cmd=source.config.cmd,
        start=spec.start,
        ready=spec.ready,
        steps=state.descriptions,
        built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        build_seconds=round(time.monotonic() - started, 2),
    )
    if (record.path / RECORD_FILE).is_file():
        log(f"template {spec.name}: {digest} was built before; nothing changed")
        return TemplateRecord.load(record.path)
    await asyncio.to_thread(_publish_template, record, disk)
    log(f"template {spec.name}: built {record.path} in {record.build_seconds:.1f} s")
    return record


def _clean_up_after_dead_builds(env: BuildEnv) -> None:
    """Remove what builds and pulls that died (killed, host crash) left: VMs, temporary
    directories."""
    env.build_vms.mkdir(parents=True, exist_ok=True)
    for run_dir in env.build_vms.iterdir():
        owner = run_dir.name.split("-")[1] if run_dir.name.count("-") >= 2 else ""
        if owner.isdigit() and Path(f"/proc/{owner}").exists():
            continue  # its build is still running
        for pid in vmm_pids(run_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)
    now = time.time()
    for parent in (env.cache, *env.templates.glob("*")):
        for tmp in [*parent.glob(".tmp-*"), *parent.glob(".pull-*")]:
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    shutil.rmtree(tmp, ignore_errors=True)


def _apply_metadata(step: Step, state: _State) -> None:
    if step.kind == "env":
        state.env.update(step.env)
    elif step.kind == "user":
        state.user = step.value


async def _source_stage(
    source: Source, spec: TemplateSpec, env: BuildEnv, cache: _Cache, key: str, log: Log
) -> Path:
    tmp = cache.new_tmp()
    try:
        image = tmp / ROOTFS_FILE
        size = spec.disk_mib << 20 if spec.disk_mib else None
        if source.image is not None:
            # Cloned from the pool's copy of the image: a reflink, not a copy across file systems.
            pooled = await asyncio.to_thread(env.pool.import_image, source.image, source.image_key)
            await asyncio.to_thread(clone_file, pooled, image)
            os.chmod(image, 0o644)
            if size:
                await asyncio.to_thread(rootfs.grow_ext4, image, size, log)
        else:
            root = tmp / "root"
            root.mkdir(mode=0o755)
            t = time.monotonic()
            await source.unpack(root, log)
            log(f"unpacked in {time.monotonic() - t:.1f} s")
            await asyncio.to_thread(rootfs.check_bootable, root)
            if source.config.workdir:
                # The image's working directory exists in every sandbox, as runtimes make it.
                await asyncio.to_thread(rootfs.ensure_dir, root, source.config.workdir)
            await asyncio.to_thread(rootfs.make_ext4, root, image, log, size_bytes=size)
            await asyncio.to_thread(shutil.rmtree, root)
        return cache.publish(tmp, key, f"source {source.ref}")
    except BaseException:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
        raise


def _copy_digest(step: Step) -> str:
    """The contents a copy step takes. One source named as it is written is hashed as it
    always was (cache keys stay those of earlier releases); otherwise the names each source
    is found under join its contents (a wildcard's matches say what lands in the image)."""
    copied = step.copied
    assert copied is not None
    if len(copied.srcs) == 1 and copied.srcs[0] == (copied.context / str(step.src_text)).resolve():
        return _source_digest(copied.srcs[0], copied)
    named = [(src.relative_to(copied.context).as_posix(), _source_digest(src, copied))
             for src in copied.srcs]  # fmt: skip
    return hashlib.sha256(json.dumps(named).encode()).hexdigest()


def _source_digest(src: Path, copied: Copied) -> str:
    if src.is_dir():
        return tree_digest(src, skip=copied.excluded if copied.ignore else None)
    h = hashlib.sha256(f"{src.stat().st_mode:o}\0".encode())
    h.update(src.read_bytes())
    return h.hexdigest()


def _copy_tar(step: Step, out: Path) -> str:
    """Write into `out` a tar of what a copy step brings in (owned by root, or by its chown
    once unpacked; with its chmod); where it goes."""
    copied = step.copied
    assert copied is not None and step.dst is not None

    def member(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        if step.chmod is not None and not info.issym():
            info.mode = step.chmod
        return info

    def add(path: Path, arcname: str) -> None:
        directory = path.is_dir() and not path.is_symlink()
        if copied.excluded(path):
            if not (directory and copied.walk_excluded(path)):
                return
        else:
            tf.add(path, arcname=arcname, filter=member, recursive=False)
        if directory:
            for child in sorted(path.iterdir()):
                add(child, f"{arcname}/{child.name}")

    into_dir = step.dst.endswith("/") or len(copied.srcs) > 1
    with tarfile.open(out, mode="w") as tf:
        dest = (step.dst.rstrip("/") or "/") if into_dir else step.dst
        for src in copied.srcs:
            if src.is_dir():  # its contents, as a directory's are
                for child in sorted(src.iterdir()):
                    add(child, child.name)
            elif into_dir:
                add(src, src.name)
            else:
                dest, _, name = step.dst.rpartition("/")
                dest = dest or "/"
                add(src, name)
    return dest


@contextlib.asynccontextmanager
async def _build_vm(
    env: BuildEnv, spec: TemplateSpec, disk: Path, log: Log
) -> AsyncIterator[Machine]:
    """A build VM on a reflink of `disk`, with its network: the disk steps of a build run in it
    one after another, as long as the block lasts."""
    images = BootImages(kernel=env.kernel, initrd=env.initrd, rootfs=disk)
    t0 = time.monotonic()
    vm_id = f"build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    async with _build_network(env, vm_id) as tap_fd:
        m = await Machine.boot(
            env.driver,
            env.pool,
            images,
            vm_id=vm_id,
            vms_dir=env.build_vms,
            vcpus=spec.vcpus,
            memory_mib=spec.memory_mib,
            hostname=f"build-{spec.name}"[:63],
            tap_fd=tap_fd,
            guest_mac=GUEST_MAC if tap_fd is not None else None,
        )
        try:
            log(f"  build VM: booted in {time.monotonic() - t0:.1f} s")
            yield m
        finally:
            await m.close()


@contextlib.asynccontextmanager
async def _build_network(env: BuildEnv, vm_id: str) -> AsyncIterator[int | None]:
    """A build VM's network (public names only, like a sandbox allowed everything), for as
    long as the VM lives; its tap fd for the VMM."""
    if env.egress is None:
        yield None
        return
    net = await env.egress.attach(vm_id, Policy(default="allow"))
    try:
        fd = env.egress.manager.open_tap(net)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        await env.egress.detach(vm_id)


async def _vm_step(
    m: Machine,
    env: BuildEnv,
    spec: TemplateSpec,
    step: Step,
    index: int,
    state: _State,
    cache: _Cache,
    key: str,
    log: Log,
    *,
    last: bool,
) -> Path:
    """Run `step` in the build VM and keep its disk as the cache entry `key`: frozen while it
    is copied, the VM going on to the next step; sealed and stopped after the `last`."""
    t1 = time.monotonic()
    if step.kind == "workdir":
        assert step.value is not None
        await _run(m, ["mkdir", "-p", step.value], state, index, step, log, cwd="/", as_user=False,
                   timeout=spec.step_timeout)  # fmt: skip
    elif step.kind == "run":
        assert step.run is not None
        if state.workdir:
            mkdir = ["mkdir", "-p", state.workdir]
            await _run(m, mkdir, state, index, step, log, cwd="/", as_user=False,
                       timeout=spec.step_timeout)  # fmt: skip
        await _run(m, step.run, state, index, step, log, timeout=spec.step_timeout,
                   user=step.value)  # fmt: skip
    elif step.kind == "copy":
        # Staged on disk and streamed: a copy step may bring in more than fits in memory.
        with tempfile.TemporaryDirectory(prefix=".tmp-copy-", dir=env.cache) as staging:
            tar = Path(staging) / "copy.tar"
            dest = await asyncio.to_thread(_copy_tar, step, tar)
            log(f"  copying {tar.stat().st_size / 1e6:.1f} MB into {dest}")
            # Isolated (-I): the template's PYTHON* variables and files are not ours.
            unpack = ["/usr/bin/python3", "-I", "-c", _UNPACK, dest,
                      *([step.chown] if step.chown else [])]  # fmt: skip
            await _run(m, unpack, state, index, step, log, cwd="/", as_user=False, input=tar,
                       timeout=spec.step_timeout)  # fmt: skip
    else:
        raise BuildError(f"step {index}: unknown kind {step.kind!r}")
    t2 = time.monotonic()
    tmp = cache.new_tmp()
    try:
        await _keep_disk(m, index, tmp / ROOTFS_FILE, last=last)
        entry = cache.publish(tmp, key, step.describe())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kept = "sealed and stopped" if last else "disk kept"
    log(f"  build VM: step {t2 - t1:.1f} s, {kept} in {time.monotonic() - t2:.1f} s")
    return entry


async def _keep_disk(m: Machine, index: int, dest: Path, *, last: bool) -> None:
    """A reflink at `dest` of the build VM's disk as step `index` left it, with nothing the
    step started still running (in the steps after it, or changing the disk as it is copied):
    after the `last` step, the VM sealed and stopped; else its root frozen for the copy (the
    ext4 flushed, its journal empty), then thawed. A guest that does not (a step that froze /
    itself, a process that will not die) fails the step."""
    try:
        if not await m.agent.end_processes():
            raise BuildError(f"step {index}: what it started would not end")
        if last:
            await _settle_disk(m)
            await asyncio.to_thread(clone_file, m.disk, dest)
            return
        await m.agent.freeze_root_fs()
        await asyncio.to_thread(clone_file, m.disk, dest)
        if not await m.agent.thaw_root_fs():
            raise BuildError(f"step {index}: the build VM's root was thawed while it was copied")
    except AgentError as e:
        raise BuildError(f"step {index}: the build VM could not keep its disk: {e}") from e


async def _settle_disk(m: Machine) -> None:
    """Leave the build disk whole, small and clean, then stop the VM.

    The agent trims the free blocks back to the sparse image, flushes, and remounts read-only
    so the ext4 needs no journal replay (its own calls: the image's tools may be anything);
    the flush is what matters, and QEMU flushes the disk as it quits.
    """
    with contextlib.suppress(AgentError):
        await m.agent.seal_root_fs()
    await m.vm.stop(timeout=SHUTDOWN_TIMEOUT)


async def _run(
    m: Machine,
    cmd: str | list[str],
    state: _State,
    index: int,
    step: Step,
    log: Log,
    *,
    cwd: str | None = None,
    as_user: bool = True,
    user: str | None = None,
    timeout: float | None = None,
    input: Path | None = None,
) -> None:
    """Run a command in the build VM (as the current user, or `user`), its output to the log;
    a failure raises BuildError."""
    proc = await m.agent.exec(
        cmd,
        env=state.env,
        cwd=cwd if cwd is not None else state.workdir,
        user=agent_user(user) if user else state.user_arg() if as_user else None,
        timeout=timeout,
        stdin=input is not None,
    )
    tail: list[str] = []
    partial = {"stdout": b"", "stderr": b""}

    def emit(text: bytes) -> None:
        line = text.decode(errors="replace").rstrip()
        tail.append(line)
        del tail[:-15]
        log(f"  | {line}")

    async def feed() -> None:
        if input is not None:
            with input.open("rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    if not await proc.write(chunk):
                        return  # the step ended: its result says how
            await proc.close_stdin()

    feeder = asyncio.ensure_future(feed())
    try:
        async for stream, data in proc:
            lines = (partial[stream] + data).split(b"\n")
            partial[stream] = lines.pop()
            for line in lines:
                emit(line)
        await feeder
    finally:
        feeder.cancel()
    for rest in partial.values():
        if rest:
            emit(rest)
    result = await proc.wait()
    if result.exit_code != 0:
        how = (
            "timed out"
            if result.timed_out
            else f"was killed by signal {result.signal}"
            if result.signal
            else f"failed with exit code {result.exit_code}"
        )
        last = "\n  ".join(tail) or "(no output)"
        raise BuildError(f"step {index} ({step.describe()}) {how}; last output:\n  {last}")


def stage_template(
    record: TemplateRecord, disk: Path, snapshot: SnapshotInfo | None = None
) -> Path:
    """The template's directory made whole beside `record.path`, hidden (a dot name) until
    renamed there: its disk, the snapshot it is made of if any (`record.snapshot`), all clones,
    and its record. Nothing is left if this fails."""
    parent = record.path.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=parent))
    try:
        clone_file(disk, tmp / ROOTFS_FILE)
        os.chmod(tmp / ROOTFS_FILE, 0o444)  # templates are immutable; sandboxes get clones
        if snapshot is not None:
            assert record.snapshot is not None
            copy = tmp / record.snapshot
            copy.mkdir(mode=0o700)  # its manifest holds the agent token it was taken with
            for name in snapshot.files.values():
                clone_file(snapshot.path / name, copy / name)
            replace(snapshot, path=copy).save()
        (tmp / RECORD_FILE).write_text(json.dumps(record.to_json(), indent=2) + "\n")
        os.chmod(tmp, 0o755)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _publish_template(record: TemplateRecord, disk: Path) -> None:
    tmp = stage_template(record, disk)
    try:
        tmp.rename(record.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (record.path / RECORD_FILE).is_file():
            raise


def list_templates(root: Path) -> list[TemplateRecord]:
    """Every built template under `root/templates`, newest build of each name last."""
    out: list[TemplateRecord] = []
    base = root / TEMPLATES_DIR
    if not base.is_dir():
        return out
    for record_file in sorted(base.glob(f"*/*/{RECORD_FILE}")):
        if record_file.parent.name.startswith("."):
            continue
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out.append(TemplateRecord.load(record_file.parent))
    out.sort(key=lambda r: (r.name, r.built_at))
    return out


def latest_templates(root: Path) -> dict[str, TemplateRecord]:
    """The newest build of each template name under `root`."""
    return {r.name: r for r in list_templates(root)}  # sorted oldest first: the last one wins


def boot_images(record: TemplateRecord, env: BuildEnv) -> BootImages:
    """What a sandbox of the template boots (e.g. for `VMManager(templates=...)`)."""
    return BootImages(kernel=env.kernel, initrd=env.initrd, rootfs=record.rootfs)


def remove_template(root: Path, name: str, digest: str | None = None) -> list[TemplateRecord]:
    """Delete one build of a template (or every build of `name`); returns what was removed.

    Sandboxes made from it keep working (their disks are clones, not references); whether any
    still needs it is the caller's question (the control plane knows, this host does not).
    """
    removed = []
    for record in list_templates(root):
        if record.name == name and digest in (None, record.digest):
            # Renamed away first, so that no reader ever sees half a template directory.
            doomed = record.path.with_name(f".tmp-rm-{record.digest}-{uuid.uuid4().hex[:6]}")
            record.path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(record)
    with contextlib.suppress(OSError):
        (root / TEMPLATES_DIR / name).rmdir()  # only if no build of it is left
    return removed


def prune_cache(root: Path, older_than_s: float) -> tuple[int, int]:
    """Remove step cache entries unused for `older_than_s`; returns (entries, bytes freed).

    Built templates do not depend on the cache (they are clones of it), so pruning costs only
    the speed of later rebuilds.
    """
    count = freed = 0
    now = time.time()
    cache = root / CACHE_DIR
    if not cache.is_dir():
        return 0, 0
    for entry in cache.iterdir():
        marker = entry / "entry.json"
        try:
            if entry.name.startswith(".") or now - marker.stat().st_mtime < older_than_s:
                continue
            freed += (entry / ROOTFS_FILE).stat().st_blocks * 512
        except OSError:
            continue
        doomed = entry.with_name(f".tmp-rm-{entry.name}")
        entry.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        count += 1
    return count, freed

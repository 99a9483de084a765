"""Debian packages for the image builders, and the plumbing the builders share.

Packages are fetched with the host's own apt (`apt-get download`, so the host's mirrors, pins and
keys apply) into `cache_dir()/debs` and reused from there. Candidate versions are asked of
`apt-cache` once and remembered until apt's lists or configuration change, because apt-cache
takes ~0.7 s here and cache hits of the builders must be instant.

The shared plumbing: `run_streamed` (a command whose output goes line by line to a log),
`CacheSlot` (a cache entry that is built in a temporary directory and published by one rename,
under a lock so that two builders never do the same work twice) and `fingerprint`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from space.paths import cache_dir

Log = Callable[[str], None]

_logger = logging.getLogger("space.images")

# Files whose change can change apt's candidate versions.
_APT_STATE_DIRS = (Path("/var/lib/apt/lists"), Path("/etc/apt"))
_APT_STATE_FILES = (Path("/var/lib/dpkg/status"),)


class ImageBuildError(RuntimeError):
    """Building a kernel, initramfs or template failed; the message says what and why."""


class DebError(ImageBuildError):
    """A Debian package could not be resolved, downloaded or unpacked."""


def log_to_logging(line: str) -> None:
    """The default `log` of the builders: the `space.images` logger at INFO."""
    _logger.info("%s", line)


# --- commands --------------------------------------------------------------------------------


def run_streamed(
    cmd: Sequence[str | os.PathLike[str]],
    log: Log,
    *,
    what: str | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    prefix: str = "",
) -> None:
    """Run `cmd`, sending each line of its stdout and stderr to `log` as it comes.

    Raises ImageBuildError with the last lines of output if the command fails or is missing.
    """
    argv = [os.fspath(a) for a in cmd]
    name = what or Path(argv[0]).name
    tail: deque[str] = deque(maxlen=15)
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            text=True,  # universal newlines: apt's "\r" progress updates become lines too
            errors="replace",
            bufsize=1,
        )
    except FileNotFoundError:
        raise ImageBuildError(f"{argv[0]} is not installed (needed for {name})") from None
    assert proc.stdout is not None
    with proc:
        try:
            for raw in proc.stdout:
                line = raw.rstrip()
                if line:
                    tail.append(line)
                    log(prefix + line)
        except BaseException:
            # Interrupted (or the log callback failed): do not leave e.g. mmdebstrap running.
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        rc = proc.wait()
    if rc != 0:
        last = "\n  ".join(tail) if tail else "(no output)"
        raise ImageBuildError(f"{name} failed with exit code {rc}; last output:\n  {last}")


def run_captured(cmd: Sequence[str | os.PathLike[str]], *, what: str | None = None) -> str:
    """Run a short command and return its stdout; failures raise ImageBuildError."""
    argv = [os.fspath(a) for a in cmd]
    name = what or Path(argv[0]).name
    try:
        res = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ImageBuildError(f"{argv[0]} is not installed (needed for {name})") from None
    if res.returncode != 0:
        raise ImageBuildError(
            f"{name} failed with exit code {res.returncode}: {res.stderr.strip() or '(no output)'}"
        )
    return res.stdout


# --- hashing ---------------------------------------------------------------------------------


def fingerprint(parts: Mapping[str, object], length: int = 16) -> str:
    """A short, stable hash of JSON-able inputs: the cache key of a build."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- cache entries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheSlot:
    """One cache entry `root/key/` that is complete once its manifest exists.

    A build happens in `root/.tmp-<key>-*` and is published with a single rename, so a reader
    never sees half an entry; builders of the same root serialise on `root/.lock`.
    """

    root: Path
    key: str
    manifest_name: str = "manifest.json"

    @property
    def path(self) -> Path:
        return self.root / self.key

    @property
    def manifest_path(self) -> Path:
        return self.path / self.manifest_name

    def load(self) -> dict[str, object] | None:
        """The manifest of a complete entry, or None if there is none."""
        try:
            data = json.loads(self.manifest_path.read_text())
        except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) else None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / ".lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def new_tmp(self) -> Path:
        """A fresh build directory next to the entry (same filesystem: rename is atomic).

        Call with the lock held: leftovers of builds that died are removed first.
        """
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{self.key}-", dir=self.root))

    def publish(self, tmp: Path, manifest: Mapping[str, object]) -> None:
        """Write the manifest into `tmp` and make `tmp` the entry, replacing an old one."""
        (tmp / self.manifest_name).write_text(json.dumps(manifest, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        old: Path | None = None
        if self.path.exists():
            old = self.root / f".tmp-{self.key}-old-{os.getpid()}-{time.monotonic_ns()}"
            self.path.rename(old)
        tmp.rename(self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# --- apt -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DebPackage:
    """A binary package at the exact version apt would install."""

    name: str
    version: str
    arch: str
    depends: str = ""

    @property
    def filename(self) -> str:
        # The name `apt-get download` gives the file: the epoch colon is URL-quoted.
        return f"{self.name}_{urllib.parse.quote(self.version, safe='+~.-')}_{self.arch}.deb"


def debs_dir() -> Path:
    return cache_dir() / "debs"


def _apt_state() -> str:
    """A hash of what decides apt's candidates: lists, configuration, installed packages."""
    stats: list[tuple[str, int, int]] = []
    paths: list[Path] = list(_APT_STATE_FILES)
    for d in _APT_STATE_DIRS:
        with contextlib.suppress(OSError):
            paths.extend(p for p in d.rglob("*") if "partial" not in p.parts and p.name != "lock")
    for p in paths:
        try:
            st = p.stat()
        except OSError:
            continue
        if not p.is_dir():
            stats.append((str(p), st.st_size, st.st_mtime_ns))
    stats.sort()
    return fingerprint({"files": stats, "APT_CONFIG": os.environ.get("APT_CONFIG", "")}, 32)


def _parse_paragraphs(text: str) -> list[dict[str, str]]:
    paras: list[dict[str, str]] = []
    cur: dict[str, str] = {}
    field = ""
    for line in text.splitlines():
        if not line.strip():
            if cur:
                paras.append(cur)
            cur, field = {}, ""
        elif line[0] in " \t":
            if field:
                cur[field] += "\n" + line.strip()
        elif ":" in line:
            field, _, value = line.partition(":")
            cur[field] = value.strip()
    if cur:
        paras.append(cur)
    return paras


def _apt_candidates(names: Sequence[str]) -> dict[str, DebPackage]:
    try:
        res = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", *names],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        raise DebError("apt-cache is not installed: image builds need a Debian host") from None
    found: dict[str, DebPackage] = {}
    for para in _parse_paragraphs(res.stdout):
        name, version = para.get("Package", ""), para.get("Version", "")
        if name in names and version and name not in found:
            found[name] = DebPackage(
                name=name,
                version=version,
                arch=para.get("Architecture", "amd64"),
                depends=para.get("Depends", ""),
            )
    missing = [n for n in names if n not in found]
    if missing:
        detail = res.stderr.strip().splitlines()
        raise DebError(
            f"apt cannot find the package(s) {', '.join(missing)}"
            + (f" ({detail[-1]})" if detail else "")
            + ". Run `apt-get update` as root so apt has the Debian package lists, then retry."
        )
    return found


def resolve(names: Iterable[str]) -> dict[str, DebPackage]:
    """The candidate (to-be-installed) version of each package, as apt-cache reports it.

    Answers are remembered in `debs_dir()/candidates.json` for as long as apt's lists and
    configuration stay the same, so repeated calls cost a few stat()s instead of apt-cache.
    """
    wanted = list(dict.fromkeys(names))
    memo_path = debs_dir() / "candidates.json"
    state = _apt_state()
    memo: dict[str, dict[str, str]] = {}
    result: dict[str, DebPackage] = {}
    try:
        data = json.loads(memo_path.read_text())
        if data.get("apt_state") == state:
            memo = data["packages"]
            result = {n: DebPackage(**memo[n]) for n in wanted if n in memo}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        memo, result = {}, {}  # missing or unreadable: ask apt
    todo = [n for n in wanted if n not in result]
    if todo:
        result.update(_apt_candidates(todo))
        for n in todo:
            p = result[n]
            memo[n] = {"name": p.name, "version": p.version, "arch": p.arch, "depends": p.depends}
        with contextlib.suppress(OSError):
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f".candidates-{os.getpid()}.json")
            tmp.write_text(json.dumps({"apt_state": state, "packages": memo}, indent=1))
            tmp.replace(memo_path)
    return {n: result[n] for n in wanted}


_CONCRETE_KERNEL = re.compile(r"^linux-image-\d")


def resolve_kernel(metapackage: str) -> DebPackage:
    """The concrete kernel image package behind a metapackage such as linux-image-cloud-amd64.

    A name that is already concrete (linux-image-6.1.0-NN-cloud-amd64) resolves to itself.
    """
    if _CONCRETE_KERNEL.match(metapackage):
        return resolve([metapackage])[metapackage]
    meta = resolve([metapackage])[metapackage]
    for alternatives in meta.depends.split(","):
        dep = alternatives.split("|")[0].strip()
        m = re.match(r"^(\S+)\s*(?:\(\s*=\s*([^)\s]+)\s*\))?", dep)
        if m and _CONCRETE_KERNEL.match(m.group(1)):
            concrete = resolve([m.group(1)])[m.group(1)]
            if m.group(2) and concrete.version != m.group(2):
                raise DebError(
                    f"{metapackage} {meta.version} wants {m.group(1)} {m.group(2)}, but apt "
                    f"offers {concrete.version}; run `apt-get update` and retry"
                )
            return concrete
    raise DebError(
        f"{metapackage} {meta.version} depends on no linux-image-<version> package "
        f"(Depends: {meta.depends or 'nothing'})"
    )


def download(pkg: DebPackage, log: Log = log_to_logging) -> Path:
    """The .deb of `pkg` in `debs_dir()`, downloaded with `apt-get download` unless present."""
    dest_dir = debs_dir()
    dest = dest_dir / pkg.filename
    if dest.is_file():
        log(f"using cached {dest.name}")
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest_dir))
    try:
        if os.geteuid() == 0:
            # apt drops to its sandbox user for downloads; let it write here instead of
            # warning and falling back to root.
            with contextlib.suppress(KeyError, OSError):
                shutil.chown(tmp, user="_apt")
        log(f"downloading {pkg.name} {pkg.version}")
        run_streamed(
            ["apt-get", "download", "-q", f"{pkg.name}={pkg.version}"],
            log,
            what=f"apt-get download {pkg.name}",
            cwd=tmp,
        )
        got = sorted(tmp.glob("*.deb"))
        if len(got) != 1:
            raise DebError(f"apt-get download {pkg.name} left {len(got)} .deb files, not one")
        got[0].rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def extract(deb: Path, dest: Path) -> None:
    """Unpack the files of a .deb into `dest` (no maintainer scripts run)."""
    dest.mkdir(parents=True, exist_ok=True)
    run_captured(["dpkg-deb", "-x", deb, dest], what=f"dpkg-deb -x {deb.name}")

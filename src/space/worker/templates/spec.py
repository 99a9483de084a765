"""The template spec, `space.toml`: where a template starts from and the steps that change it.

[template]
name = "web"
from = "oci://localhost:5000/python:3.11-slim"   # see sources.py for every kind
insecure = true          # a plain-HTTP registry (local ones only)
disk_mib = 2048          # the build disk (default: content + headroom)
memory_mib = 512         # the build VM
start = "python3 -m http.server 8000"            # started in each sandbox
ready = "python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000\")'"

[template.registry]      # credentials by the names of environment variables, never literal
username_env = "REGISTRY_USER"
password_env = "REGISTRY_PASSWORD"

[[steps]]
run = "pip install -r /app/requirements.txt"
[[steps]]
copy = { src = "app/", dst = "/app" }      # src is relative to the spec's directory
[[steps]]   # several sources or a wildcard go into a directory (dst ends with /)
copy = { src = ["*.py", "conf/"], dst = "/srv/", chown = "app:app", chmod = "0644" }
[[steps]]
env = { APP_ENV = "prod" }
[[steps]]
workdir = "/app"
[[steps]]
user = "nobody"
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
import posixpath
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import tomli_w
from e2b_dockerfile_utils import PatternMatcher

from space.worker.templates.errors import SpecError
from space.worker.templates.registry import Credentials
from space.worker.templates.sources import SourceRef

SPEC_FILE = "space.toml"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
OWNER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?$")
MODE = re.compile(r"^0?[0-7]{3,4}$")
MAX_SPEC_BYTES = 1 << 20  # what a worker takes
MAX_IGNORE_BYTES = 1 << 20
MAX_IGNORE_PATTERNS = 1000
MAX_PATTERN_CHARS = 256
MAX_PATTERN_STARS = 4
MAX_MATCHES = 10_000  # paths one wildcard source may name
STEP_KINDS = ("run", "copy", "env", "workdir", "user")
# Steps that change only how later processes run, not the disk: they need no VM.
METADATA_KINDS = ("env", "user")


@dataclass(frozen=True)
class Copied:
    """What a copy step takes of the spec's directory: its sources (absolute paths inside it,
    wildcards expanded) less what the ignore file excludes (paths relative to it)."""

    context: Path
    srcs: tuple[Path, ...]
    ignore: tuple[str, ...] = ()

    def excluded(self, path: Path) -> bool:
        return bool(self.ignore) and _matcher(self.ignore).matches(self._rel(path))

    def walk_excluded(self, directory: Path) -> bool:
        """Whether an excluded directory must still be walked: a `!` pattern may take back
        something under it."""
        return _matcher(self.ignore).may_match_under(self._rel(directory))

    def _rel(self, path: Path) -> str:
        return path.relative_to(self.context).as_posix()


@dataclass(frozen=True)
class Step:
    kind: str
    run: str | None = None
    copied: Copied | None = None
    src_text: str | None = None  # copy: as written in the spec
    dst: str | None = None
    chown: str | None = None  # copy: "user[:group]", names or ids, resolved in the image
    chmod: int | None = None  # copy: the mode of every file and directory it brings in
    env: dict[str, str] = field(default_factory=dict)
    value: str | None = None  # workdir, user; the user a run step runs as, if not the current

    def describe(self) -> str:
        if self.kind == "run":
            return f"run: {self.run}" if self.value is None else f"run as {self.value}: {self.run}"
        if self.kind == "copy":
            how = "".join(
                f" ({k} {v})" for k, v in (("chown", self.chown), ("chmod", self.chmod_text))
                if v is not None
            )  # fmt: skip
            return f"copy: {self.src_text} -> {self.dst}{how}"
        if self.kind == "env":
            return "env: " + " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{self.kind}: {self.value}"

    def identity(self) -> dict[str, Any]:
        """What of the step goes into its cache key (copied contents are added by the builder).
        An owner or mode joins it only when set, so steps without keep the keys they had."""
        owned = {k: v for k, v in (("chown", self.chown), ("chmod", self.chmod)) if v is not None}
        return {
            "kind": self.kind,
            "run": self.run,
            "src": self.src_text,
            "dst": self.dst,
            "env": self.env,
            "value": self.value,
        } | owned

    @property
    def chmod_text(self) -> str | None:
        return None if self.chmod is None else f"{self.chmod:04o}"


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    source: SourceRef
    context: Path  # the spec's directory: copy sources and relative paths live under it
    steps: list[Step] = field(default_factory=list)
    start: str | None = None
    ready: str | None = None
    insecure: bool = False
    username_env: str | None = None
    password_env: str | None = None
    disk_mib: int | None = None
    memory_mib: int = 512
    vcpus: int = 1
    step_timeout: float = 3600.0

    def credentials(self, environ: Mapping[str, str] | None = None) -> Credentials | None:
        """The registry credentials, read from the environment variables the spec names."""
        if self.username_env is None:
            return None
        env = os.environ if environ is None else environ
        missing = [n for n in (self.username_env, self.password_env) if n and n not in env]
        if missing:
            raise SpecError(
                f"template {self.name}: the registry credentials come from the environment "
                f"variable(s) {', '.join(missing)}, which are not set"
            )
        assert self.password_env is not None
        return Credentials(env[self.username_env], env[self.password_env])


def spec_text(template: Mapping[str, Any], steps: list[dict[str, Any]], made_of: str) -> str:
    """A spec's text, as other front ends (a Dockerfile, E2B's steps) make one; `made_of`
    names what it was made of for the error of one too large for a worker."""
    text = tomli_w.dumps({"template": template, "steps": steps})
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise SpecError(f"{made_of} makes a spec larger than {MAX_SPEC_BYTES} bytes")
    return text


def leaves_context(path: str) -> bool:
    """Whether a normalised path, read in a build's context, names something outside it."""
    return path.startswith("/") or path == ".." or path.startswith("../")


def image_path(workdir: str, path: str, directory: bool = False) -> str:
    """`path` in the image, a relative one under `workdir`; a directory's ends with / (a copy
    step's way of saying "into")."""
    joined = posixpath.normpath(posixpath.join(workdir, path))
    return f"{joined.rstrip('/')}/" if directory else joined


def load_spec(path: Path) -> TemplateSpec:
    """Read and check a spec file (a directory means its space.toml)."""
    if path.is_dir():
        path = path / SPEC_FILE
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read the template spec {path}: {e.strerror}") from None
    return parse_spec(text, path.parent.resolve(), where=str(path))


def _keys(table: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(table) - set(allowed))
    if unknown:
        raise SpecError(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})"
        )


def _str(table: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    value = table.get(key)
    if value is None:
        if required:
            raise SpecError(f"{where}: '{key}' is required")
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(f"{where}: '{key}' must be a non-empty string")
    return value


def _int(table: Mapping[str, Any], key: str, where: str, lo: int, hi: int) -> int | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise SpecError(f"{where}: '{key}' must be a whole number from {lo} to {hi}")
    return value


def parse_spec(text: str, context: Path, *, where: str = SPEC_FILE) -> TemplateSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{where} is not valid TOML: {e}") from None
    _keys(data, ("template", "steps"), where)
    tpl = data.get("template")
    if not isinstance(tpl, dict):
        raise SpecError(f"{where}: a [template] table with 'name' and 'from' is required")
    w = f"{where} [template]"
    _keys(
        tpl,
        ("name", "from", "insecure", "registry", "disk_mib", "memory_mib", "vcpus", "start",
         "ready", "step_timeout", "ignore_file"),
        w,
    )  # fmt: skip
    name = _str(tpl, "name", w, required=True)
    assert name is not None
    if not _NAME.match(name):
        raise SpecError(f"{w}: name {name!r} must be lower-case letters, digits, '.', '_', '-'")
    source_text = _str(tpl, "from", w, required=True)
    assert source_text is not None
    source = SourceRef.parse(source_text, context)
    insecure = tpl.get("insecure", False)
    if not isinstance(insecure, bool):
        raise SpecError(f"{w}: 'insecure' must be true or false")

    username_env = password_env = None
    reg = tpl.get("registry")
    if reg is not None:
        wr = f"{where} [template.registry]"
        if not isinstance(reg, dict):
            raise SpecError(f"{wr} must be a table")
        for literal in ("username", "password", "token"):
            if literal in reg:
                raise SpecError(
                    f"{wr}: '{literal}' is not accepted: secrets never go into spec files; put "
                    f"it in an environment variable and name that with '{literal}_env'"
                    if literal != "token"
                    else f"{wr}: tokens are not supported; use username_env and password_env"
                )
        _keys(reg, ("username_env", "password_env"), wr)
        username_env = _str(reg, "username_env", wr, required=True)
        password_env = _str(reg, "password_env", wr, required=True)
        for var in (username_env, password_env):
            assert var is not None
            if not _ENV_NAME.match(var):
                raise SpecError(f"{wr}: {var!r} is not an environment variable name")

    raw_steps = data.get("steps", [])
    if not isinstance(raw_steps, list):
        raise SpecError(f"{where}: 'steps' must be an array of tables ([[steps]])")
    ignore = _ignore_patterns(context, _str(tpl, "ignore_file", w), w)
    steps = [_step(s, i, context, ignore, where) for i, s in enumerate(raw_steps, 1)]
    step_timeout = tpl.get("step_timeout", 3600)
    if not isinstance(step_timeout, int | float) or step_timeout <= 0:
        raise SpecError(f"{w}: 'step_timeout' must be a positive number of seconds")
    return TemplateSpec(
        name=name,
        source=source,
        context=context,
        steps=steps,
        start=_str(tpl, "start", w),
        ready=_str(tpl, "ready", w),
        insecure=insecure,
        username_env=username_env,
        password_env=password_env,
        disk_mib=_int(tpl, "disk_mib", w, 256, 1 << 20),
        memory_mib=_int(tpl, "memory_mib", w, 128, 65536) or 512,
        vcpus=_int(tpl, "vcpus", w, 1, 64) or 1,
        step_timeout=float(step_timeout),
    )


def _ignore_patterns(context: Path, name: str | None, where: str) -> tuple[str, ...]:
    """The patterns of the spec's ignore file (`.dockerignore` syntax), if it names one and
    the spec's directory holds it: what no copy step takes."""
    if name is None:
        return ()
    path = _inside(context, name, f"{where}: ignore_file")
    if not path.is_file():
        return ()
    if path.stat().st_size > MAX_IGNORE_BYTES:
        raise SpecError(f"{where}: ignore_file {name!r} is larger than {MAX_IGNORE_BYTES} bytes")
    lines = (line.strip() for line in path.read_text(errors="replace").splitlines())
    patterns = tuple(line for line in lines if line and not line.startswith("#"))
    # Bounded: a pattern of many '*' matches by backtracking, in time that grows as a power.
    if len(patterns) > MAX_IGNORE_PATTERNS:
        raise SpecError(f"{where}: ignore_file {name!r} has more than {MAX_IGNORE_PATTERNS} "
                        "patterns")  # fmt: skip
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_CHARS or pattern.count("*") > MAX_PATTERN_STARS:
            raise SpecError(f"{where}: ignore_file {name!r}: pattern {pattern[:80]!r} is longer "
                            f"than {MAX_PATTERN_CHARS} characters or has more than "
                            f"{MAX_PATTERN_STARS} '*'")  # fmt: skip
    try:
        _matcher(patterns)
    except ValueError as e:
        raise SpecError(f"{where}: ignore_file {name!r}: {e}") from None
    return patterns


@functools.lru_cache(maxsize=16)
def _matcher(patterns: tuple[str, ...]) -> PatternMatcher:
    return PatternMatcher(list(patterns))


def _inside(context: Path, text: str, what: str) -> Path:
    path = (context / text).resolve()
    if path != context and context not in path.parents:
        raise SpecError(f"{what} {text!r} is outside the spec's directory {context}")
    return path


def _step(raw: Any, i: int, context: Path, ignore: tuple[str, ...], where: str) -> Step:
    w = f"{where} step {i}"
    if not isinstance(raw, dict):
        raise SpecError(f"{w}: each [[steps]] entry must be a table")
    kinds = [k for k in STEP_KINDS if k in raw]
    _keys(raw, STEP_KINDS, w)
    if len(kinds) != 1:
        raise SpecError(f"{w}: give exactly one of {', '.join(STEP_KINDS)} (got {len(kinds)})")
    kind = kinds[0]
    if kind == "run":
        if not isinstance(raw["run"], dict):
            return Step("run", run=_str(raw, "run", w, required=True))
        # { cmd = "...", user = "root" }: this command as that user, the steps after as before
        _keys(raw["run"], ("cmd", "user"), f"{w} run")
        cmd, user = _str(raw["run"], "cmd", f"{w} run", True), _str(raw["run"], "user", w)
        return Step("run", run=cmd, value=user)
    if kind in ("workdir", "user"):
        value = _str(raw, kind, w, required=True)
        assert value is not None
        if kind == "workdir" and not value.startswith("/"):
            raise SpecError(f"{w}: workdir must be an absolute path")
        return Step(kind, value=value)
    if kind == "env":
        env = raw["env"]
        if not isinstance(env, dict) or not env:
            raise SpecError(f'{w}: env must be a table of NAME = "value"')
        for k, v in env.items():
            if not _ENV_NAME.match(k) or not isinstance(v, str):
                raise SpecError(f"{w}: env {k!r} must be a variable name with a string value")
        return Step("env", env=dict(env))
    copy = raw["copy"]
    if not isinstance(copy, dict):
        raise SpecError(f'{w}: copy must be a table {{ src = "...", dst = "/..." }}')
    wc = f"{w} copy"
    _keys(copy, ("src", "dst", "chown", "chmod"), wc)
    src = copy.get("src")
    texts = [src] if isinstance(src, str) else src
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip()
                                                            for t in texts):  # fmt: skip
        raise SpecError(f"{wc}: 'src' must be a path or a non-empty list of paths")
    dst = _str(copy, "dst", wc, required=True)
    assert dst is not None
    if not dst.startswith("/"):
        raise SpecError(f"{w}: copy dst must be an absolute path in the image")
    copied = Copied(context, (), ignore)
    srcs = tuple(p for t in texts for p in _sources(copied, t, f"{w}: copy src"))
    if len(srcs) > 1 and not dst.endswith("/"):
        raise SpecError(f"{w}: copy of several files (or a wildcard) needs a directory as its "
                        f"dst, ending with '/' (got {dst!r})")  # fmt: skip
    chown = _str(copy, "chown", wc)
    if chown is not None and not OWNER.match(chown):
        raise SpecError(f"{wc}: chown {chown!r} must be 'user', 'user:group' (names or ids)")
    mode = _str(copy, "chmod", wc)
    if mode is not None and not MODE.match(mode):
        raise SpecError(f"{wc}: chmod {mode!r} must be an octal mode such as '0755'")
    return Step(
        "copy",
        copied=replace(copied, srcs=srcs),
        src_text=src if isinstance(src, str) else " ".join(texts),
        dst=dst,
        chown=chown,
        chmod=None if mode is None else int(mode, 8),
    )


def _sources(copied: Copied, text: str, what: str) -> list[Path]:
    """What a copy source names: one path (a name that exists is itself, wildcards or not),
    or what its wildcards match, inside the context and not excluded by its ignore file."""
    context = copied.context
    named = context / text
    if not glob.has_magic(text) or os.path.lexists(named):
        path = _inside(context, text, what)
        if not path.exists():
            raise SpecError(f"{what} {text!r} does not exist ({path})")
        if path != context and copied.excluded(path):
            raise SpecError(f"{what} {text!r} is excluded by the ignore file")
        return [path]
    found = sorted({_inside(context, m, what) for m in _glob(context, text, what)} - {context})
    found = [p for p in found if not copied.excluded(p)]
    if not found:
        raise SpecError(f"{what} {text!r} matches nothing in {context}")
    return found


def _glob(context: Path, pattern: str, what: str) -> list[str]:
    """The paths under `context` that `pattern` matches, name by name as Docker matches them
    (a `*` matches dot files too), never through a symbolic link to a directory; at most
    MAX_MATCHES of them."""
    parts = [part for part in pattern.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise SpecError(f"{what} {pattern!r}: a wildcard source cannot go up with '..'")
    level = [""]
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        matched = []
        for rel in level:
            try:
                entries = list(os.scandir(context / rel))
            except OSError:
                continue
            for entry in entries:
                if fnmatch.fnmatchcase(entry.name, part) and (
                    last or entry.is_dir(follow_symlinks=False)
                ):
                    matched.append(f"{rel}/{entry.name}" if rel else entry.name)
            if len(matched) > MAX_MATCHES:
                raise SpecError(f"{what} {pattern!r} matches more than {MAX_MATCHES} paths")
        level = matched
    return level

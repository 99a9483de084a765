"""A Dockerfile as a template spec: each instruction becomes what `space.toml` says of it.

Parsed by `e2b-dockerfile-utils` (BuildKit's parser and shell lexer, ported), and turned into
the text of a spec, so that a Dockerfile build is a spec build (the same step cache, the same
log) and the spec it became can be read back. Variables are expanded as Docker does: `ARG`
and `ENV` values in `FROM`, `ENV`, `WORKDIR`, `USER` and `COPY`; a `RUN` sees its build
arguments in its environment, and its shell expands the rest.

| instruction | becomes |
|---|---|
| `FROM image` / `FROM space:NAME` | `from = "oci://image"` / `"space:NAME"` |
| `RUN` (shell or exec form) | a `run` step |
| `COPY` / `ADD` of the context (`--chown`, `--chmod`) | a `copy` step (`.dockerignore` kept) |
| `ENV`, `WORKDIR`, `USER` | `env`, `workdir`, `user` steps |
| `ARG` | expanded where used (`build_args` override the defaults) |
| `CMD` / `ENTRYPOINT` | the template's `start` |
| `HEALTHCHECK CMD` | the template's `ready` check |
| `EXPOSE`, `LABEL`, `MAINTAINER` | nothing: they change neither the disk nor how it runs |

Anything else is refused with its line and the reason.
"""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from e2b_dockerfile_utils import (
    DockerfileInstruction,
    DockerfileSyntaxError,
    ShellLex,
    parse_dockerfile_ast,
)

from space.worker.templates.errors import SpecError
from space.worker.templates.spec import MODE, OWNER, image_path, leaves_context, spec_text

IGNORE_FILE = ".dockerignore"
MAX_DOCKERFILE_BYTES = 1 << 20
MAX_VALUE_BYTES = 64 << 10  # an expanded value
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://|^git@", re.IGNORECASE)
_ARCHIVE = re.compile(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2?|tar\.xz|txz|tar\.zst)$", re.IGNORECASE)
# Instructions that change neither the disk nor how the template's processes run.
_NOTHING = frozenset({"EXPOSE", "LABEL", "MAINTAINER"})
_HEALTHCHECK_TIMING = frozenset(
    {"interval", "timeout", "start-period", "start-interval", "retries"}
)
_REFUSED = {
    "SHELL": "RUN uses /bin/sh -c; write the other shell into the command instead",
    "VOLUME": "volumes are attached to a sandbox when it is created (`volumes` in its create)",
    "ONBUILD": "templates are not parents of later builds",
    "STOPSIGNAL": "sandboxes are stopped by the platform, not by a signal to their start command",
}


class DockerfileError(SpecError):
    """A Dockerfile SPACE cannot build, with the line and the reason."""


@dataclass
class _Build:
    name: str
    build_args: Mapping[str, str]
    insecure: bool
    source: str | None = None
    args: dict[str, str] = field(default_factory=dict)  # ARGs in scope, with their values
    globals: dict[str, str] = field(default_factory=dict)  # those declared before FROM
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    steps: list[dict[str, Any]] = field(default_factory=list)
    entrypoint: tuple[list[str], bool] | None = None  # its words, and whether in exec form
    cmd: tuple[list[str], bool] | None = None
    ready: str | None = None

    def expand(self, word: str, line: int) -> str:
        lexer = ShellLex("\\", env={**self.args, **self.env}, skip_unset_env=False)
        try:
            value = lexer.process_word(word)
        except ValueError as e:
            raise DockerfileError(f"Dockerfile line {line}: {e}") from None
        if len(value.encode()) > MAX_VALUE_BYTES:
            raise DockerfileError(
                f"Dockerfile line {line}: a value expands to more than {MAX_VALUE_BYTES} bytes"
            )
        return value


def dockerfile_spec(
    text: str, name: str, build_args: Mapping[str, str] | None = None, *, insecure: bool = False
) -> str:
    """The `space.toml` text of the template `name` that this Dockerfile describes."""
    if len(text.encode()) > MAX_DOCKERFILE_BYTES:
        raise DockerfileError(f"the Dockerfile is larger than {MAX_DOCKERFILE_BYTES} bytes")
    try:
        ast = parse_dockerfile_ast(text)
    except DockerfileSyntaxError as e:
        raise DockerfileError(str(e)) from None
    if ast.escape_token != "\\":
        raise DockerfileError("Dockerfile: only the default escape character (\\) is supported")
    build = _Build(name, dict(build_args or {}), insecure)
    for ins in ast.instructions:
        _instruction(build, ins)
    if build.source is None:
        raise DockerfileError("Dockerfile: no FROM: a template starts from an image")
    template: dict[str, Any] = {"name": name, "from": build.source, "ignore_file": IGNORE_FILE}
    if insecure:
        template["insecure"] = True
    if start := _start(build):
        template["start"] = start
    if build.ready:
        template["ready"] = build.ready
    # Its build arguments are repeated at every RUN: that is what makes a spec grow.
    return spec_text(template, build.steps, "the Dockerfile (its ARGs at every RUN)")


def _instruction(b: _Build, ins: DockerfileInstruction) -> None:
    line, kind = ins.start_line, ins.name

    def refuse(why: str) -> DockerfileError:
        return DockerfileError(f"Dockerfile line {line}: {kind}: {why}")

    if ins.heredocs:
        raise refuse("here-documents are not supported; COPY a script and RUN it")
    if kind == "ARG":
        _arg(b, ins, refuse)
        return
    if kind == "FROM":
        _from(b, ins, refuse)
        return
    if b.source is None:
        raise refuse("only ARG may come before the first FROM")
    flags = _flags(ins, refuse)
    if kind in ("COPY", "ADD"):
        _copy(b, ins, flags, refuse)
        return
    if kind == "HEALTHCHECK":  # how often it runs is Docker's; SPACE runs it until it passes
        flags = {k: v for k, v in flags.items() if k not in _HEALTHCHECK_TIMING}
    if flags:
        raise refuse(f"the option(s) {', '.join(sorted(flags))} are not supported")
    if kind == "RUN":
        if not (command := _command(ins.args, ins.json)).strip():
            raise refuse("an empty command")
        b.steps.append({"run": _exports(b) + command})
    elif kind == "ENV":
        _env(b, ins, refuse)
    elif kind == "WORKDIR":
        b.workdir = image_path(b.workdir, b.expand(_one(ins, refuse), line))
        b.steps.append({"workdir": b.workdir})
    elif kind == "USER":
        b.steps.append({"user": b.expand(_one(ins, refuse), line)})
    elif kind == "CMD":
        b.cmd = (list(ins.args), ins.json)
    elif kind == "ENTRYPOINT":
        b.entrypoint = (list(ins.args), ins.json)
    elif kind == "HEALTHCHECK":
        _healthcheck(b, ins, refuse)
    elif kind in _REFUSED:
        raise refuse(_REFUSED[kind])
    elif kind not in _NOTHING:
        raise refuse("not a Dockerfile instruction SPACE knows")


def _flags(ins: DockerfileInstruction, refuse: Any) -> dict[str, str]:
    flags: dict[str, str] = {}
    for flag in ins.flags:
        key, sep, value = flag.removeprefix("--").partition("=")
        if not sep or not value:
            raise refuse(f"the option {flag!r} needs a value (--{key}=...)")
        flags[key] = value
    return flags


def _one(ins: DockerfileInstruction, refuse: Any) -> str:
    if len(ins.args) != 1:
        raise refuse("takes exactly one argument")
    return ins.args[0]


def _arg(b: _Build, ins: DockerfileInstruction, refuse: Any) -> None:
    if ins.flags:
        raise refuse("takes no options")
    for word in ins.args:
        key, sep, default = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise refuse(f"{key!r} is not a variable name")
        if key in b.build_args:
            b.args[key] = b.build_args[key]
        elif sep:
            b.args[key] = b.expand(default, ins.start_line)
        elif key in b.globals:
            b.args[key] = b.globals[key]


def _from(b: _Build, ins: DockerfileInstruction, refuse: Any) -> None:
    if b.source is not None:
        raise refuse("multi-stage builds are not supported: give one FROM (and no COPY --from)")
    flags = _flags(ins, refuse)
    platform = flags.pop("platform", "linux/amd64")
    if flags:
        raise refuse(f"the option(s) {', '.join(sorted(flags))} are not supported")
    if platform not in ("linux/amd64", "linux/x86_64"):
        raise refuse(f"templates run on linux/amd64, not {platform}")
    if len(ins.args) not in (1, 3) or (len(ins.args) == 3 and ins.args[1].lower() != "as"):
        raise refuse("takes an image and, optionally, AS name")
    image = b.expand(ins.args[0], ins.start_line)
    if not image:
        raise refuse(f"{ins.args[0]!r} names no image")
    # An ARG before FROM is in scope for FROM only, unless declared again after it.
    b.globals, b.args = b.args, {}
    if image == "scratch":
        raise refuse("an empty image has no python3, which the guest agent runs on")
    if "://" in image:
        raise refuse(f"{image!r}: name an image (registry/name:tag) or a space: template")
    b.source = image if image.startswith("space:") else f"oci://{image}"


def _env(b: _Build, ins: DockerfileInstruction, refuse: Any) -> None:
    words = ins.args
    if len(words) % 3 or not words:
        raise refuse("takes NAME=value pairs")
    values: dict[str, str] = {}
    for i in range(0, len(words), 3):
        key, value = words[i], b.expand(words[i + 1], ins.start_line)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise refuse(f"{key!r} is not a variable name")
        values[key] = value
    b.env |= values
    b.steps.append({"env": values})


def _copy(b: _Build, ins: DockerfileInstruction, flags: dict[str, str], refuse: Any) -> None:
    if "from" in flags:
        raise refuse("COPY --from (multi-stage builds) is not supported")
    unknown = sorted(set(flags) - {"chown", "chmod", "link"})
    if unknown:
        raise refuse(f"the option(s) {', '.join(unknown)} are not supported")
    if len(ins.args) < 2:
        raise refuse("takes one or more sources and a destination")
    *srcs, dst = (b.expand(w, ins.start_line) for w in ins.args)
    for i, src in enumerate(srcs):
        if _URL.match(src):
            raise refuse(
                f"{src}: a build fetches nothing from outside its context (that would pass "
                "the egress policy by); RUN curl or git instead"
            )
        if ins.name == "ADD" and _ARCHIVE.search(src):
            raise refuse(f"{src}: ADD unpacks archives, which SPACE does not; COPY it, RUN tar")
        # As Docker: sources are in the context, a leading / too; none above it.
        srcs[i] = posixpath.normpath(src.lstrip("/") or ".")
        if leaves_context(srcs[i]):
            raise refuse(f"{src}: a source outside the build context")
    dst = image_path(b.workdir, dst, directory=dst.endswith("/") or dst in (".", ".."))
    step: dict[str, Any] = {"src": srcs[0] if len(srcs) == 1 else srcs, "dst": dst}
    for key, form in (("chown", OWNER), ("chmod", MODE)):
        if key in flags:
            step[key] = value = b.expand(flags[key], ins.start_line)
            if not form.match(value):
                raise refuse(f"--{key}={value}: must match {form.pattern}")
    b.steps.append({"copy": step})


def _healthcheck(b: _Build, ins: DockerfileInstruction, refuse: Any) -> None:
    if not ins.args:
        raise refuse("takes NONE or CMD and a command")
    if ins.args[0].upper() == "NONE":
        b.ready = None
        return
    if ins.args[0].upper() != "CMD" or len(ins.args) < 2:
        raise refuse("takes NONE or CMD and a command")
    b.ready = _command(ins.args[1:], ins.json)


def _command(words: list[str], exec_form: bool) -> str:
    """A shell command line: the exec form quoted word by word, the shell form as written."""
    return shlex.join(words) if exec_form else " ".join(words)


def _exports(b: _Build) -> str:
    """Build arguments for a RUN: in its environment, as Docker passes them, not kept after."""
    names = [k for k in b.args if k not in b.env]
    if not names:
        return ""
    return "export " + " ".join(f"{k}={shlex.quote(b.args[k])}" for k in names) + "; "


def _start(b: _Build) -> str | None:
    """The template's start command: ENTRYPOINT then CMD, as Docker joins them (a shell form
    is `/bin/sh -c` of it, and a shell-form ENTRYPOINT takes no CMD)."""
    words = [*_argv(b.entrypoint)]
    if b.entrypoint is None or b.entrypoint[1]:
        words += _argv(b.cmd)
    return shlex.join(words) if words else None


def _argv(form: tuple[list[str], bool] | None) -> list[str]:
    if form is None:
        return []
    words, exec_form = form
    return list(words) if exec_form else ["/bin/sh", "-c", " ".join(words)]

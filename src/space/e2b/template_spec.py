"""The steps of E2B's template builder as a SPACE template spec, and the files its COPY steps
uploaded as the build's context.

- `fromImage`: `from = "oci://image"` (plain HTTP only for a registry on a local address);
  E2B's own base, `e2bdev/base`, is SPACE's `space:base`.
- `fromTemplate` `base` / `code-interpreter`: `space:base` / `space:code-interpreter`.
- `fromImageRegistry` of type `registry`: the build's registry credentials (never stored).
- `RUN` (`[cmd, user]`): a `run` step, as that user if it names one.
- `COPY` (`[src, dest, user, mode]`, `filesHash`): a `copy` step of the files uploaded under
  that hash.
- `ENV`, `WORKDIR`, `USER`: `env`, `workdir`, `user` steps; `startCmd`, `readyCmd`: `start`,
  `ready`.

`force` (skip the cache) is not honoured: a step runs again when what it is made of changes.
"""

from __future__ import annotations

import gzip
import io
import posixpath
import re
import tarfile
from typing import Any

from pydantic import Field, model_validator

from space.api.errors import APIError
from space.e2b.rest import Lenient
from space.worker.api.models import MAX_CONTEXT_B64
from space.worker.templates.errors import SpecError, TemplateError
from space.worker.templates.registry import ImageReference, is_local_host
from space.worker.templates.spec import MODE, OWNER, image_path, leaves_context, spec_text

FILES_HASH = re.compile(r"^[0-9a-f]{64}$")
MAX_STEPS = 256
MAX_CONTEXT_BYTES = 64 << 20  # what a build's uploaded files may hold, unpacked (headers too)
MAX_CONTEXT_MEMBERS = 100_000
MAX_CREDENTIAL = 32768  # a value of a build's environment, as a worker takes it
_SURROGATE = re.compile("[\ud800-\udfff]")
E2B_BASES = {"e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base"}
SPACE_TEMPLATES = ("base", "code-interpreter")
REGISTRY_USER, REGISTRY_PASSWORD = "E2B_REGISTRY_USERNAME", "E2B_REGISTRY_PASSWORD"


class BuildStep(Lenient):
    type: str = Field(max_length=32)
    args: list[str] = Field(default_factory=list, max_length=1024)
    files_hash: str | None = Field(None, alias="filesHash", max_length=64)
    force: bool = False


class StartBuild(Lenient):
    steps: list[BuildStep] = Field(default_factory=list, max_length=MAX_STEPS)
    from_image: str | None = Field(None, alias="fromImage", max_length=512)
    from_template: str | None = Field(None, alias="fromTemplate", max_length=128)
    from_image_registry: dict[str, str] | None = Field(None, alias="fromImageRegistry",
                                                      max_length=8)  # fmt: skip
    start_cmd: str | None = Field(None, alias="startCmd", max_length=65536)
    ready_cmd: str | None = Field(None, alias="readyCmd", max_length=65536)
    force: bool = False

    @model_validator(mode="after")
    def text(self) -> StartBuild:
        """Every string is text a spec and a database hold: no NUL, no lone surrogate."""
        strings = [self.from_image, self.from_template, self.start_cmd, self.ready_cmd,
                   *(self.from_image_registry or {}).values(),
                   *(a for step in self.steps for a in step.args)]  # fmt: skip
        for value in strings:
            if value is not None and ("\x00" in value or _SURROGATE.search(value)):
                raise ValueError("a NUL or a lone surrogate is in a step or a command")
        return self


def steps_spec(template_id: str, body: StartBuild) -> tuple[str, dict[str, str]]:
    """The spec's text, and the environment its registry credentials are read from."""
    template, environ = _source(body)
    template["name"] = template_id
    if body.start_cmd:
        template["start"] = body.start_cmd
    if body.ready_cmd:
        template["ready"] = body.ready_cmd
    workdir: str | None = None  # the image's until a WORKDIR step says
    steps: list[dict[str, Any]] = []
    for i, step in enumerate(body.steps, 1):
        kind, args = step.type.upper(), step.args

        def bad(why: str, i: int = i, kind: str = kind) -> APIError:
            return APIError(400, f"step {i} ({kind}): {why}")

        if kind == "RUN":
            if not args or not args[0].strip() or len(args) > 2:
                raise bad("takes a command and, optionally, a user")
            user = args[1] if len(args) == 2 and args[1] else None
            steps.append({"run": {"cmd": args[0], "user": user} if user else args[0]})
        elif kind == "COPY":
            steps.append({"copy": _copy(step, workdir, bad)})
        elif kind == "ENV":
            if not args or len(args) % 2:
                raise bad("takes names and values, one after the other")
            steps.append({"env": dict(zip(args[::2], args[1::2], strict=True))})
        elif kind in ("WORKDIR", "USER"):
            if len(args) != 1 or not args[0]:
                raise bad("takes one argument")
            if kind == "WORKDIR":
                workdir = _absolute(workdir, args[0], bad)
                steps.append({"workdir": workdir})
            else:
                steps.append({"user": args[0]})
        else:
            raise bad("SPACE builds RUN, COPY, ENV, WORKDIR and USER steps")
    try:
        return spec_text(template, steps, "the build's steps"), environ
    except SpecError as e:
        raise APIError(400, str(e)) from None


def _source(body: StartBuild) -> tuple[dict[str, Any], dict[str, str]]:
    if body.from_template is not None:
        if body.from_image is not None:
            raise APIError(400, "give fromImage or fromTemplate, not both")
        if body.from_template not in SPACE_TEMPLATES:
            own = ", ".join(SPACE_TEMPLATES)
            raise APIError(400, f"fromTemplate {body.from_template!r}: a build starts from one "
                                f"of SPACE's images ({own}) or an image")  # fmt: skip
        return {"from": f"space:{body.from_template}"}, {}
    image = body.from_image or "e2bdev/base"
    if image in E2B_BASES:
        return {"from": "space:base"}, {}
    try:
        host = ImageReference.parse(image).registry
    except (ValueError, TemplateError) as e:
        raise APIError(400, f"fromImage {image!r}: {e}") from None
    template: dict[str, Any] = {"from": f"oci://{image}"}
    if is_local_host(host):
        template["insecure"] = True
    registry = body.from_image_registry
    if registry is None:
        return template, {}
    if registry.get("type") != "registry":
        raise APIError(400, f"fromImageRegistry of type {registry.get('type')!r}: SPACE pulls "
                            "with a user name and password (type registry)")  # fmt: skip
    user, password = registry.get("username"), registry.get("password")
    if not user or not password or max(len(user), len(password)) > MAX_CREDENTIAL:
        raise APIError(400, "fromImageRegistry needs a username and a password (of at most "
                            f"{MAX_CREDENTIAL} characters)")  # fmt: skip
    template["registry"] = {"username_env": REGISTRY_USER, "password_env": REGISTRY_PASSWORD}
    return template, {REGISTRY_USER: user, REGISTRY_PASSWORD: password}


def _absolute(workdir: str | None, path: str, bad: Any) -> str:
    """`path` in the image: a relative one under the working directory a WORKDIR step set."""
    if not path.startswith("/") and workdir is None:
        raise bad(f"{path!r} is relative: give a WORKDIR step before it, or an absolute path")
    return image_path(workdir or "/", path, directory=path.endswith("/"))


def _copy(step: BuildStep, workdir: str | None, bad: Any) -> dict[str, Any]:
    args = [*step.args, "", ""][:4]
    if not 2 <= len(step.args) <= 4 or not args[0] or not args[1]:
        raise bad("takes a source, a destination and, optionally, a user and a mode")
    if step.files_hash is None or not FILES_HASH.fullmatch(step.files_hash):
        raise bad("needs the filesHash of its uploaded files")
    src, dest, user, mode = args
    src = posixpath.normpath(src)
    if leaves_context(src):
        raise bad(f"{src!r}: sources are in the template's file context")
    copy: dict[str, Any] = {"src": f"{step.files_hash}/{src}",
                            "dst": _absolute(workdir, dest, bad)}  # fmt: skip
    if user:
        if not OWNER.match(user):
            raise bad(f"user {user!r} must match {OWNER.pattern}")
        copy["chown"] = user
    if mode:
        if not MODE.match(mode):
            raise bad(f"mode {mode!r} must be octal, such as 0755")
        copy["chmod"] = mode
    return copy


def build_files(uploaded: dict[str, bytes], hashes: list[str]) -> bytes:
    """The build's context: each COPY step's files under a directory named by their hash.
    Read as streams, every byte unpacked counted (a tar's own headers too): bounded in memory
    whatever the upload claims."""
    missing = sorted(set(hashes) - set(uploaded))
    if missing:
        raise APIError(400, f"the files of hash {missing[0]} were not uploaded (ask for "
                            "them again: uploads are kept a day)")  # fmt: skip
    out = io.BytesIO()
    budget = _Budget()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=6) as context:
        for files_hash in sorted(set(hashes)):
            data = uploaded[files_hash]
            # Gzipped unless the SDK was told `gzip=False`.
            raw = io.BytesIO(data)
            stream = _Counted(gzip.GzipFile(fileobj=raw) if data[:2] == b"\x1f\x8b" else raw,
                              budget)  # fmt: skip
            try:
                with tarfile.open(fileobj=stream, mode="r|") as tf:
                    for member in tf:
                        budget.members += 1
                        if budget.members > MAX_CONTEXT_MEMBERS:
                            raise APIError(413, f"the uploaded files are more than "
                                                f"{MAX_CONTEXT_MEMBERS}")  # fmt: skip
                        _repack(context, tf, member, files_hash)
            except (tarfile.TarError, gzip.BadGzipFile, EOFError, OSError) as e:
                raise APIError(400, f"the files of hash {files_hash} are not a tar: {e}") from None
    if len(out.getbuffer()) > MAX_CONTEXT_B64 * 3 // 4:
        raise APIError(413, "the uploaded files make a build context larger than a worker takes")
    return out.getvalue()


class _Budget:
    def __init__(self) -> None:
        self.bytes = 0
        self.members = 0


class _Counted(io.RawIOBase):
    """A stream that refuses to give more than the budget's bytes, all streams together."""

    def __init__(self, inner: gzip.GzipFile | io.BytesIO, budget: _Budget) -> None:
        self.inner, self.budget = inner, budget

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.inner.read(min(len(b), 1 << 20))
        self.budget.bytes += len(data)
        if self.budget.bytes > MAX_CONTEXT_BYTES:
            raise APIError(413, f"the uploaded files hold more than {MAX_CONTEXT_BYTES >> 20} "
                                "MiB unpacked")  # fmt: skip
        b[: len(data)] = data
        return len(data)


def _repack(context: tarfile.TarFile, tf: tarfile.TarFile, member: tarfile.TarInfo,
            files_hash: str) -> None:  # fmt: skip
    name = posixpath.normpath(member.name)
    inside = not leaves_context(name)
    if member.issym():  # a link stays among the files it came with (an absolute one leaves)
        target = posixpath.normpath(posixpath.join(posixpath.dirname(name), member.linkname))
        inside = inside and not leaves_context(target)
    if not inside or not (member.isreg() or member.isdir() or member.issym()):
        raise APIError(400, f"the files of hash {files_hash}: {member.name!r} is not a file, "
                            "directory or link inside the file context")  # fmt: skip
    copy = tarfile.TarInfo(f"{files_hash}/{name}" if name != "." else files_hash)
    copy.type, copy.mode, copy.size = member.type, member.mode & 0o7777, member.size
    copy.linkname, copy.mtime = member.linkname, member.mtime
    context.addfile(copy, tf.extractfile(member) if member.isreg() else None)

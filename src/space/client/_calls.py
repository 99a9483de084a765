"""What the sync and the async client share: the HTTP API's calls as plain data.

Each function here returns a `Call`: the request to make and how to read its answer. A client
only sends it, over httpx.Client or httpx.AsyncClient; so paths, query parameters, bodies and the
parsing of answers are written once, here, for both, as are the option types of their methods
and the part of a sandbox handle that does no I/O.
"""

from __future__ import annotations

import base64
import io
import ssl
import tarfile
from collections.abc import AsyncIterable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypedDict, TypeVar, runtime_checkable
from urllib.parse import quote

import httpx
from e2b_dockerfile_utils import PatternMatcher

from space import __version__
from space.client._config import resolve_credentials
from space.client._errors import SpaceError
from space.client._models import (
    AuditEvent,
    AuditRecord,
    CheckpointInfo,
    Event,
    FileEntry,
    HostUsage,
    PreviewLink,
    ProcessInfo,
    SandboxInfo,
    SecretInfo,
    TemplateInfo,
    Usage,
    VolumeInfo,
)

T = TypeVar("T")
HTTPClient = TypeVar("HTTPClient", httpx.Client, httpx.AsyncClient)


class _HasBaseURL(Protocol):
    @property
    def base_url(self) -> str: ...


Client = TypeVar("Client", bound=_HasBaseURL)  # Space or AsyncSpace

SANDBOXES = "/v1/sandboxes"
TEMPLATES = "/v1/templates"
VOLUMES = "/v1/volumes"
# Lifecycle calls answer once the change is done, which the API waits for up to 300 s.
DEFAULT_TIMEOUT = 330.0
CHUNK_SIZE = 1 << 20


class CreateOptions(TypedDict, total=False):
    """What `create` accepts; anything left out (or None) gets the server's default."""

    template: str | None
    vcpus: int | None
    memory_mib: int | None
    disk_mib: int | None
    timeout_s: int | None
    timeout_action: Literal["pause", "suspend", "delete"] | None
    idle_timeout_s: int | None  # paused after this long unused, resumed by its next use; 0: never
    env: Mapping[str, str] | None
    metadata: Mapping[str, str] | None
    id: str | None  # a client-chosen id: creating it again answers the same sandbox
    # [{"volume": "vol-…", "path": "/data", "read_only": False}]: volumes to mount (at most 2)
    volumes: Sequence[Mapping[str, Any]] | None
    # {"default": "deny", "hosts": [{"pattern": "pypi.org"}], "cidrs": [...]}: egress policy
    network: Mapping[str, Any] | None
    # [{"secret": "name", "hosts": [...], "header": "...", "env": "..."}]: bound secrets
    secrets: Sequence[Mapping[str, Any]] | None
    idempotency_key: str | None
    wait: bool | None  # False: answer at once, before the sandbox is running
    room_wait_s: float | None  # no worker has room: wait this long for some before the 503


class ListFilters(TypedDict, total=False):
    """Which sandboxes `list` answers; all of them when none is given."""

    state: str | None
    template: str | None
    metadata: Mapping[str, str] | None  # labels the sandbox must all have


class ExecOptions(TypedDict, total=False):
    """How to run a command; anything left out (or None) gets the sandbox's default."""

    env: Mapping[str, str] | None
    cwd: str | None
    user: str | None
    timeout: float | None  # seconds, then the process is killed
    stdin: bytes | str | None  # fed to the process, then closed (unless keep_stdin)
    keep_stdin: bool | None  # stdin stays open for `processes.send_stdin`
    background: bool | None  # it outlives its stream: leaving the stream leaves it running
    tag: str | None  # names the running process for `sandbox.processes` (implies background)
    pty: bool | None  # a terminal: stdout and stderr merge, as they do on a screen
    rows: int | None  # the PTY's size (default 24 x 80)
    cols: int | None


class RequestOptions(TypedDict, total=False):
    """An HTTP request to a sandbox's port (`sandbox.request`), as httpx takes it."""

    content: bytes | str
    json: Any
    headers: Mapping[str, str]
    params: Mapping[str, str]
    timeout: float  # seconds for the answer (default: the client's)


@runtime_checkable
class Readable(Protocol):
    """A binary file object (anything with `read(size) -> bytes`)."""

    def read(self, size: int, /) -> bytes: ...


Upload = bytes | str | Readable | Iterable[bytes]


def http_client(
    kind: type[HTTPClient],
    base_url: str | None,
    api_key: str | None,
    timeout: float,
    raise_for_error: Callable[[httpx.Response], Any],
) -> HTTPClient:
    """The httpx client of a `Space` or `AsyncSpace`; `raise_for_error` turns error answers
    into our exceptions (a response hook: it sees every answer, streamed or not)."""
    credentials = resolve_credentials(base_url, api_key)
    return kind(
        base_url=credentials.api_url,
        verify=_tls_context(credentials.api_url),
        headers={
            "Authorization": f"Bearer {credentials.api_key}",
            "User-Agent": f"space-python/{__version__}",
        },
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        event_hooks={"response": [raise_for_error]},
    )


def _tls_context(api_url: str) -> ssl.SSLContext | bool:
    """httpx's default verification for an https:// API. An http:// one is never spoken to over
    TLS (every request goes to the base URL and redirects are not followed), so it gets a
    context without CAs: loading them costs ~45 ms per client, and should TLS ever happen on
    it, verification fails instead of passing."""
    if api_url.lower().startswith("https:"):
        return True
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


class SandboxBase(Generic[Client]):
    """The I/O-free part of `Sandbox` and `AsyncSandbox`: the client and the latest info."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def state(self) -> str:
        return self.info.state

    def port_url(self, port: int, path: str = "/") -> str:
        """Where `path` on `port` inside the sandbox is reached through the API; requests to it
        carry the API key, as `request` sends them."""
        return self._client.base_url.rstrip("/") + port_path(self.id, port, path)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, state={self.state!r})"


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API request and how to read its answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: Sequence[tuple[str, str]] = ()
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Exec and file transfers last as long as the work does: no read timeout for them.
    unbounded: bool = False

    def request(
        self,
        client: httpx.Client | httpx.AsyncClient,
        content: bytes | Iterable[bytes] | AsyncIterable[bytes] | None = None,
    ) -> httpx.Request:
        timeout = client.timeout
        if self.unbounded:
            timeout = httpx.Timeout(
                connect=timeout.connect, read=None, write=timeout.write, pool=timeout.pool
            )
        return client.build_request(
            self.method,
            self.path,
            params=list(self.params),
            json=self.body,
            headers=dict(self.headers),
            content=content,
            timeout=timeout,
        )

    def answer(self, response: httpx.Response) -> T:
        try:
            return self.parse(response)
        except (KeyError, TypeError, ValueError) as e:
            raise SpaceError(
                f"unexpected answer to {self.method} {self.path} (is {response.url.host} "
                f"a SPACE API of this version?): {e!r}"
            ) from e


def _json(build: Callable[[Any], T]) -> Callable[[httpx.Response], T]:
    return lambda response: build(response.json())


def _nothing(_: httpx.Response) -> None:
    return None


def _sandbox(sandbox_id: str, tail: str = "") -> str:
    return f"{SANDBOXES}/{quote(sandbox_id, safe='')}{tail}"


def _flag(value: bool) -> str:
    return "true" if value else "false"


# Sandboxes


def create(options: CreateOptions) -> Call[SandboxInfo]:
    given = {k: v for k, v in options.items() if v is not None}
    key = given.pop("idempotency_key", None)
    headers = {"Idempotency-Key": str(key)} if key else {}
    wait = bool(given.pop("wait", True))
    params = [("wait", _flag(wait))]
    if (room_wait := given.pop("room_wait_s", None)) is not None:
        params.append(("room_wait_s", str(room_wait)))
    for listed in ("volumes", "secrets"):
        given.pop(listed, None)
    body = {k: dict(v) if isinstance(v, Mapping) else v for k, v in given.items()}
    if options.get("volumes") is not None:
        body["volumes"] = [dict(v) for v in options.get("volumes") or ()]
    if options.get("secrets") is not None:
        body["secrets"] = [dict(v) for v in options.get("secrets") or ()]
    return Call(
        "POST",
        SANDBOXES,
        _json(SandboxInfo.from_json),
        params=params,
        body=body,
        headers=headers,
    )


def get(sandbox_id: str) -> Call[SandboxInfo]:
    return Call("GET", _sandbox(sandbox_id), _json(SandboxInfo.from_json))


def lifecycle(sandbox_id: str, action: Literal["pause", "resume", "suspend"]) -> Call[SandboxInfo]:
    return Call(
        "POST",
        _sandbox(sandbox_id, f"/{action}"),
        _json(SandboxInfo.from_json),
        params=[("wait", "true")],
    )


def delete(sandbox_id: str) -> Call[SandboxInfo]:
    return Call(
        "DELETE", _sandbox(sandbox_id), _json(SandboxInfo.from_json), params=[("wait", "true")]
    )


def set_timeout(sandbox_id: str, timeout_s: int) -> Call[SandboxInfo]:
    return Call(
        "PUT",
        _sandbox(sandbox_id, "/timeout"),
        _json(SandboxInfo.from_json),
        body={"timeout_s": timeout_s},
    )


def events(sandbox_id: str) -> Call[list[Event]]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/events"),
        _json(lambda data: [Event.from_json(item) for item in data["items"]]),
    )


def set_network(sandbox_id: str, network: Mapping[str, Any] | None) -> Call[SandboxInfo]:
    return Call(
        "PUT",
        _sandbox(sandbox_id, "/network"),
        _json(SandboxInfo.from_json),
        body={"network": network},
    )


def audit(sandbox_id: str, after: int) -> Call[list[AuditEvent]]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/audit"),
        _json(lambda data: [AuditEvent.from_json(item) for item in data["items"]]),
        params=[("after", str(after))],
    )


# Checkpoints and forks


def checkpoint(sandbox_id: str, name: str) -> Call[CheckpointInfo]:
    return Call(
        "POST", _sandbox(sandbox_id, "/checkpoints"), _json(CheckpointInfo.from_json),
        body={"name": name},
    )  # fmt: skip


def checkpoints(sandbox_id: str) -> Call[list[CheckpointInfo]]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/checkpoints"),
        _json(lambda data: [CheckpointInfo.from_json(item) for item in data["items"]]),
    )


def checkpoint_id_of(checkpoint: str | CheckpointInfo) -> str:
    return checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint


def _checkpoint(sandbox_id: str, checkpoint_id: str, tail: str = "") -> str:
    return _sandbox(sandbox_id, f"/checkpoints/{quote(checkpoint_id, safe='')}{tail}")


def delete_checkpoint(sandbox_id: str, checkpoint_id: str) -> Call[None]:
    return Call("DELETE", _checkpoint(sandbox_id, checkpoint_id), _nothing)


def rollback(sandbox_id: str, checkpoint_id: str) -> Call[SandboxInfo]:
    return Call(
        "POST", _checkpoint(sandbox_id, checkpoint_id, "/rollback"), _json(SandboxInfo.from_json)
    )


def fork(
    sandbox_id: str,
    count: int,
    checkpoint_id: str | None,
    env: Mapping[str, str] | None,
    metadata: Mapping[str, str] | None,
) -> Call[list[SandboxInfo]]:
    body: dict[str, Any] = {"count": count, "env": dict(env or {}),
                            "metadata": dict(metadata or {})}  # fmt: skip
    if checkpoint_id is not None:
        body["checkpoint"] = checkpoint_id
    return Call(
        "POST",
        _sandbox(sandbox_id, "/fork"),
        _json(lambda data: [SandboxInfo.from_json(item) for item in data["items"]]),
        body=body,
    )


# Templates and warm pools


def templates() -> Call[list[TemplateInfo]]:
    return Call(
        "GET", TEMPLATES, _json(lambda data: [TemplateInfo.from_json(t) for t in data["items"]])
    )


def template(name: str) -> Call[TemplateInfo]:
    return Call("GET", _template(name), _json(TemplateInfo.from_json))


def build_template(name: str, spec: Path, environ: Mapping[str, str]) -> Call[TemplateInfo]:
    """Build `name` from a space.toml; its directory (the files copy steps bring in) goes along
    as the build context."""
    body = {"spec": spec.read_text(), "environ": dict(environ),
            "context": _tar(spec.parent, lambda info: info)}  # fmt: skip
    return Call("POST", _template(name, "/builds"), _json(TemplateInfo.from_json), body=body)


def build_from_dockerfile(
    name: str, dockerfile: Path, context: Path, build_args: Mapping[str, str], insecure: bool
) -> Call[TemplateInfo]:
    """Build `name` from a Dockerfile; `context` goes along, less what its .dockerignore
    excludes (which the worker applies again)."""
    ignore = context / ".dockerignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    matcher = PatternMatcher([s for line in lines if (s := line.strip()) and s[0] != "#"])

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        path = info.name.removeprefix("./")
        if path in (".", ".dockerignore") or not matcher.matches(path):
            return info
        # An excluded directory goes along (to be walked) when a `!` pattern takes back some
        # of it.
        return info if info.isdir() and matcher.may_match_under(path) else None

    body = {"dockerfile": dockerfile.read_text(), "build_args": dict(build_args),
            "insecure": insecure, "context": _tar(context, keep)}  # fmt: skip
    return Call("POST", _template(name, "/builds"), _json(TemplateInfo.from_json), body=body)


def _tar(directory: Path, keep: Callable[[tarfile.TarInfo], tarfile.TarInfo | None]) -> str:
    """A directory as the base64 of a gzipped tar, with what `keep` keeps."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(directory, arcname=".", filter=keep)
    return base64.b64encode(buf.getvalue()).decode()


def template_from_checkpoint(name: str, sandbox_id: str, checkpoint_id: str) -> Call[TemplateInfo]:
    body = {"checkpoint": {"sandbox_id": sandbox_id, "checkpoint_id": checkpoint_id}}
    return Call("POST", _template(name, "/builds"), _json(TemplateInfo.from_json), body=body)


def build_log(name: str) -> Call[None]:
    return Call("GET", _template(name, "/build/log"), _nothing, unbounded=True)


def delete_template(name: str) -> Call[TemplateInfo]:
    return Call("DELETE", _template(name), _json(TemplateInfo.from_json))


def _template(name: str, tail: str = "") -> str:
    return f"{TEMPLATES}/{quote(name, safe='')}{tail}"


def set_pool(
    template: str, size: int, vcpus: int | None, memory_mib: int | None, disk_mib: int | None
) -> Call[TemplateInfo]:
    shape = {"vcpus": vcpus, "memory_mib": memory_mib, "disk_mib": disk_mib}
    return Call(
        "PUT",
        _template(template, "/pool"),
        _json(TemplateInfo.from_json),
        body={"size": size, **{k: v for k, v in shape.items() if v is not None}},
    )


# Volumes


def create_volume(name: str, size_mib: int) -> Call[VolumeInfo]:
    body = {"name": name, "size_mib": size_mib}
    return Call("POST", VOLUMES, _json(VolumeInfo.from_json), body=body)


def volumes() -> Call[list[VolumeInfo]]:
    return Call(
        "GET", VOLUMES, _json(lambda data: [VolumeInfo.from_json(v) for v in data["items"]])
    )


def delete_volume(volume_id: str) -> Call[VolumeInfo]:
    return Call("DELETE", f"{VOLUMES}/{quote(volume_id, safe='')}", _json(VolumeInfo.from_json))


class AuditFilters(TypedDict, total=False):
    """Which entries of the control plane's audit log `audit_log` answers."""

    since: datetime | None
    until: datetime | None
    tenant: str | None  # an admin key's question: one tenant's entries
    key: str | None
    subject: str | None  # an id the call named in its path or made
    action: str | None  # a part of the route, e.g. "/pause" or "DELETE"


def audit_log(after: int, limit: int, filters: AuditFilters) -> Call[list[AuditRecord]]:
    params = [("after", str(after)), ("limit", str(limit)), *_params(filters)]
    return Call(
        "GET",
        "/v1/audit",
        _json(lambda data: [AuditRecord.from_json(item) for item in data["items"]]),
        params=params,
    )


class UsageFilters(TypedDict, total=False):
    """Whose usage `usage` and `usage_hosts` answer, and over which range (default: the last
    day)."""

    since: datetime | None
    until: datetime | None
    tenant: str | None  # an admin key's question: one tenant's usage
    sandbox: str | None
    template: str | None
    label: str | None  # only sandboxes whose metadata has this "KEY=VALUE"


def _params(filters: Mapping[str, object]) -> list[tuple[str, str]]:
    params = []
    for name, value in filters.items():
        if isinstance(value, datetime):
            params.append((name, value.isoformat()))
        elif isinstance(value, str):
            params.append((name, value))
    return params


def usage(step: str, by: str, filters: UsageFilters) -> Call[Usage]:
    params = [("step", step), ("by", by), *_params(filters)]
    return Call("GET", "/v1/usage", _json(Usage.from_json), params=params)


def usage_hosts(limit: int, filters: UsageFilters) -> Call[list[HostUsage]]:
    return Call(
        "GET",
        "/v1/usage/hosts",
        _json(lambda data: [HostUsage.from_json(item) for item in data["items"]]),
        params=[("limit", str(limit)), *_params(filters)],
    )


SECRETS = "/v1/secrets"


def set_secret(name: str, value: str) -> Call[SecretInfo]:
    return Call("PUT", f"{SECRETS}/{quote(name, safe='')}", _json(SecretInfo.from_json),
                body={"value": value})  # fmt: skip


def secrets() -> Call[list[SecretInfo]]:
    return Call(
        "GET", SECRETS, _json(lambda data: [SecretInfo.from_json(s) for s in data["items"]])
    )


def delete_secret(name: str) -> Call[None]:
    return Call("DELETE", f"{SECRETS}/{quote(name, safe='')}", _nothing)


class Pages:
    """The listing, page by page: send `next_call()` until it is None."""

    def __init__(self, filters: ListFilters, limit: int = 100) -> None:
        self._params = [("limit", str(limit))]
        for name in ("state", "template"):
            if value := filters.get(name):
                self._params.append((name, str(value)))
        metadata = filters.get("metadata") or {}
        self._params += [(f"metadata.{k}", v) for k, v in metadata.items()]
        self._cursor: str | None = None
        self._done = False

    def next_call(self) -> Call[list[SandboxInfo]] | None:
        if self._done:
            return None
        cursor = [("cursor", self._cursor)] if self._cursor else []
        return Call("GET", SANDBOXES, _json(self._take), params=self._params + cursor)

    def _take(self, data: Any) -> list[SandboxInfo]:
        items = [SandboxInfo.from_json(item) for item in data["items"]]
        self._cursor = data.get("next_cursor")
        self._done = not self._cursor
        return items


# Exec


def exec_body(command: str | Sequence[str], options: ExecOptions) -> dict[str, Any]:
    """The exec request: a string runs through `/bin/sh -c`, a sequence is the argv itself."""
    body: dict[str, Any] = {"cmd": command} if isinstance(command, str) else {"argv": list(command)}
    for key in ("env", "cwd", "user", "timeout", "keep_stdin", "background", "tag", "pty",
                "rows", "cols"):  # fmt: skip
        value = options.get(key)
        if value is not None:
            body[key] = dict(value) if isinstance(value, Mapping) else value
    stdin = options.get("stdin")
    if stdin is not None:
        raw = stdin.encode() if isinstance(stdin, str) else stdin
        body["stdin"] = base64.b64encode(raw).decode()
    return body


def exec_(sandbox_id: str, command: str | Sequence[str], options: ExecOptions) -> Call[None]:
    """Answers an NDJSON stream (see `_exec.ExecDecoder`)."""
    return Call(
        "POST",
        _sandbox(sandbox_id, "/exec"),
        _nothing,
        body=exec_body(command, options),
        unbounded=True,
    )


def exec_ws_path(sandbox_id: str) -> str:
    return _sandbox(sandbox_id, "/exec/ws")


# Processes

ProcessRef = int | str | ProcessInfo  # a pid, a tag, or the process itself


def _process(sandbox_id: str, ref: ProcessRef, tail: str = "") -> str:
    name = ref.pid if isinstance(ref, ProcessInfo) else ref
    return _sandbox(sandbox_id, f"/processes/{quote(str(name), safe='')}{tail}")


def start_process(
    sandbox_id: str, command: str | Sequence[str], options: ExecOptions
) -> Call[ProcessInfo]:
    body = exec_body(command, options)
    return Call("POST", _sandbox(sandbox_id, "/processes"), _json(ProcessInfo.from_json),
                body=body)  # fmt: skip


def processes(sandbox_id: str) -> Call[list[ProcessInfo]]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/processes"),
        _json(lambda data: [ProcessInfo.from_json(p) for p in data["processes"]]),
    )


def process(sandbox_id: str, ref: ProcessRef) -> Call[ProcessInfo]:
    return Call("GET", _process(sandbox_id, ref), _json(ProcessInfo.from_json))


def process_output(sandbox_id: str, ref: ProcessRef, replay: bool) -> Call[None]:
    """Answers an NDJSON stream, as `exec_` does."""
    return Call("GET", _process(sandbox_id, ref, "/output"), _nothing,
                params=[("replay", _flag(replay))], unbounded=True)  # fmt: skip


def process_stdin(sandbox_id: str, ref: ProcessRef, eof: bool) -> Call[None]:
    return Call("POST", _process(sandbox_id, ref, "/stdin"), _nothing,
                params=[("eof", _flag(eof))])  # fmt: skip


def signal_process(sandbox_id: str, ref: ProcessRef, signal: int) -> Call[None]:
    return Call("POST", _process(sandbox_id, ref, "/signal"), _nothing,
                body={"signal": int(signal)})  # fmt: skip


def resize_process(sandbox_id: str, ref: ProcessRef, rows: int, cols: int) -> Call[None]:
    return Call("POST", _process(sandbox_id, ref, "/resize"), _nothing,
                body={"rows": rows, "cols": cols})  # fmt: skip


def kill_process(sandbox_id: str, ref: ProcessRef) -> Call[None]:
    return Call("DELETE", _process(sandbox_id, ref), _nothing)


# Ingress

# What the API adds to every answer that a sandbox's service gave (RFC 9110 Via): its status is
# the service's own, not an API error.
INGRESS_VIA = "1.1 space"


def link(sandbox_id: str, port: int, expires_in_s: int) -> Call[PreviewLink]:
    return Call(
        "POST",
        _sandbox(sandbox_id, "/links"),
        _json(PreviewLink.from_json),
        body={"port": port, "expires_in_s": expires_in_s},
    )


def port_path(sandbox_id: str, port: int, path: str = "/") -> str:
    return _sandbox(sandbox_id, f"/ports/{int(port)}/{path.lstrip('/')}")


def from_the_service(response: httpx.Response) -> bool:
    return INGRESS_VIA in response.headers.get_list("via", split_commas=True)


# Files


def logs(sandbox_id: str, tail: int, follow: bool) -> Call[None]:
    params = [("tail", str(tail)), ("follow", str(follow).lower())]
    return Call("GET", _sandbox(sandbox_id, "/logs"), _nothing, params=params, unbounded=True)


def read_file(sandbox_id: str, path: str) -> Call[bytes]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/files"),
        lambda r: r.content,
        params=[("path", path)],
        unbounded=True,
    )


def write_file(sandbox_id: str, path: str, mode: int | None, make_parents: bool) -> Call[int]:
    params = [("path", path), ("make_parents", _flag(make_parents))]
    if mode is not None:
        params.append(("mode", str(mode)))
    return Call(
        "PUT",
        _sandbox(sandbox_id, "/files"),
        _json(lambda data: int(data["size"])),
        params=params,
        unbounded=True,
    )


def list_files(sandbox_id: str, path: str) -> Call[list[FileEntry]]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/files/list"),
        _json(lambda data: [FileEntry.from_json(e) for e in data["entries"]]),
        params=[("path", path)],
    )


def stat(sandbox_id: str, path: str) -> Call[FileEntry]:
    return Call(
        "GET",
        _sandbox(sandbox_id, "/files/stat"),
        _json(FileEntry.from_json),
        params=[("path", path)],
    )


def remove(sandbox_id: str, path: str, recursive: bool) -> Call[None]:
    return Call(
        "DELETE",
        _sandbox(sandbox_id, "/files"),
        _nothing,
        params=[("path", path), ("recursive", _flag(recursive))],
    )


def watch(sandbox_id: str, path: str, recursive: bool) -> Call[None]:
    """Answers an NDJSON stream of the watch's events (see `_watch`)."""
    params = [("path", path), ("recursive", _flag(recursive))]
    return Call("GET", _sandbox(sandbox_id, "/files/watch"), _nothing, params, unbounded=True)


def rename(sandbox_id: str, path: str, to: str, overwrite: bool) -> Call[FileEntry]:
    return Call(
        "POST",
        _sandbox(sandbox_id, "/files/rename"),
        _json(FileEntry.from_json),
        params=[("path", path), ("to", to), ("overwrite", _flag(overwrite))],
    )


def mkdir(sandbox_id: str, path: str, parents: bool) -> Call[FileEntry]:
    return Call(
        "POST",
        _sandbox(sandbox_id, "/files/mkdir"),
        _json(FileEntry.from_json),
        params=[("path", path), ("parents", _flag(parents))],
    )


def read_chunks(f: Readable, size: int = CHUNK_SIZE) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


def upload_content(data: Upload) -> bytes | Iterable[bytes]:
    """A request body for `write`: bytes as they are, text as UTF-8, a file object in chunks."""
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes):
        return data
    if isinstance(data, Readable):
        return read_chunks(data)
    return data

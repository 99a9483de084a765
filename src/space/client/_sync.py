"""The synchronous SDK: `Space` (a connection to the API) and `Sandbox` (one sandbox), over
httpx.Client. Requests and answers come from `_calls`; this module only sends them."""

from __future__ import annotations

import builtins
import codecs
import contextlib
import functools
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, Unpack

import httpx

from space.client import _calls as calls
from space.client._calls import (
    Call,
    CreateOptions,
    ExecOptions,
    ListFilters,
    ProcessRef,
    RequestOptions,
    SandboxBase,
    Upload,
    checkpoint_id_of,
)
from space.client._errors import NotFoundError, error_from_response, transport_errors
from space.client._exec import ExecStreamBase, Output, OutputCallback, OutputCollector
from space.client._models import (
    AuditEvent,
    AuditRecord,
    CheckpointInfo,
    Event,
    ExecResult,
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
from space.client._pty import Pty
from space.client._watch import FileWatch

T = TypeVar("T")


def _raise_for_error(response: httpx.Response) -> None:
    if response.is_error and not calls.from_the_service(response):
        response.read()
        raise error_from_response(response)


class Space:
    """A connection to a SPACE API server.

    `base_url` and `api_key` default to SPACE_API_URL and SPACE_API_KEY, then to the credentials
    file that `space up` writes. `timeout` is how long to wait for an answer, in seconds (exec
    and file transfers are not limited). Close it (or use `with`) to release its connections.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = calls.DEFAULT_TIMEOUT,
    ) -> None:
        self._http = calls.http_client(httpx.Client, base_url, api_key, timeout, _raise_for_error)

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Space:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_volume(self, size_mib: int = 1024, name: str = "") -> VolumeInfo:
        """An empty volume to attach at sandbox create (`volumes=[{"volume": id, "path": …}]`)."""
        return self._call(calls.create_volume(name, size_mib))

    def volumes(self) -> list[VolumeInfo]:
        return self._call(calls.volumes())

    def delete_volume(self, volume_id: str) -> VolumeInfo:
        """Deletes its data; refused while a sandbox that is not deleted has it."""
        return self._call(calls.delete_volume(volume_id))

    def audit_log(
        self, after: int = 0, limit: int = 100, **filters: Unpack[calls.AuditFilters]
    ) -> list[AuditRecord]:
        """The control plane's audit log, oldest first, from the entry after id `after`: the
        tenant's own entries (an admin key's: everyone's, or `tenant`'s)."""
        return self._call(calls.audit_log(after, limit, filters))

    def usage(
        self, step: str = "1h", by: str = "total", **filters: Unpack[calls.UsageFilters]
    ) -> Usage:
        """What sandboxes and volumes were given and used, a point per `step` ("60s", "1h",
        "1d"), as a whole or `by` tenant, sandbox, template or "label:KEY": the tenant's own
        (an admin key's: everyone's, or `tenant`'s)."""
        return self._call(calls.usage(step, by, filters))

    def usage_hosts(
        self, limit: int = 100, **filters: Unpack[calls.UsageFilters]
    ) -> list[HostUsage]:
        """The hosts sandboxes' gateways sent most to, with the bytes each way."""
        return self._call(calls.usage_hosts(limit, filters))

    def set_secret(self, name: str, value: str) -> SecretInfo:
        """Create or replace a secret (sealed at rest); bind it to a sandbox's hosts with
        `secrets=[{"secret": name, "hosts": [...], "env": "VAR"}]` at create."""
        return self._call(calls.set_secret(name, value))

    def secrets(self) -> list[SecretInfo]:
        """The tenant's secrets, by name: never a value."""
        return self._call(calls.secrets())

    def delete_secret(self, name: str) -> None:
        """Refused (ConflictError) while a sandbox that is not deleted has it bound."""
        self._call(calls.delete_secret(name))

    def template(self, name: str) -> TemplateInfo:
        return self._call(calls.template(name))

    def build_template(
        self, name: str, spec: str | Path, environ: Mapping[str, str] | None = None
    ) -> TemplateInfo:
        """Start building `name` from a space.toml (admin keys only); `environ` gives the values
        of the variables it names for registry credentials. Follow it with `build_log`."""
        return self._call(calls.build_template(name, Path(spec), environ or {}))

    def build_from_dockerfile(
        self,
        name: str,
        dockerfile: str | Path,
        context: str | Path | None = None,
        build_args: Mapping[str, str] | None = None,
        insecure: bool = False,
    ) -> TemplateInfo:
        """Start building `name` from a Dockerfile (admin keys only); `context` (default: the
        Dockerfile's directory) goes along, less what its .dockerignore excludes. Follow it
        with `build_log`."""
        path = Path(dockerfile)
        call = calls.build_from_dockerfile(
            name, path, Path(context or path.parent), build_args or {}, insecure
        )
        return self._call(call)

    def template_from_checkpoint(
        self, name: str, sandbox_id: str, checkpoint: str | CheckpointInfo
    ) -> TemplateInfo:
        """Start making template `name` of one of your checkpoints (admin keys only): its disk,
        and its memory with the processes running, so sandboxes of it start as it was, in its
        shape. Follow it with `build_log`."""
        return self._call(
            calls.template_from_checkpoint(name, sandbox_id, checkpoint_id_of(checkpoint))
        )

    def build_log(self, name: str) -> Iterator[str]:
        """The lines of the template's last build log, as they come, until the build ends."""
        buf = b""
        for chunk in self._stream(calls.build_log(name)):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            yield from (line.decode(errors="replace") for line in lines)

    def delete_template(self, name: str) -> TemplateInfo:
        """Refused while a sandbox uses it (admin keys only)."""
        return self._call(calls.delete_template(name))

    def templates(self) -> list[TemplateInfo]:
        """Every template, with the state of its warm pool."""
        return self._call(calls.templates())

    def set_pool(
        self,
        template: str,
        size: int,
        *,
        vcpus: int | None = None,
        memory_mib: int | None = None,
        disk_mib: int | None = None,
    ) -> TemplateInfo:
        """Keep `size` sandboxes of this shape restored and ready for `template` (admin keys
        only); creates of exactly that shape are then served from the pool."""
        return self._call(calls.set_pool(template, size, vcpus, memory_mib, disk_mib))

    def _call(self, call: Call[T], content: bytes | Iterable[bytes] | None = None) -> T:
        with transport_errors(self.base_url):
            return call.answer(self._http.send(call.request(self._http, content)))

    def _stream(self, call: Call[Any]) -> Generator[bytes]:
        with transport_errors(self.base_url):
            response = self._http.send(call.request(self._http), stream=True)
            try:
                yield from response.iter_bytes()
            finally:
                response.close()


@functools.cache
def _default_client() -> Space:
    """The client of sandboxes made without one, configured from the environment."""
    return Space()


class ExecStream(ExecStreamBase):
    """A running command: iterate it for `("stdout" | "stderr", bytes)` as the output comes,
    then read `result`. Closing it (or leaving its `with` block) early stops reading."""

    def __init__(self, client: Space, call: Call[None]) -> None:
        super().__init__()
        self._output = self._read(client, call)

    def _read(self, client: Space, call: Call[None]) -> Generator[Output]:
        with contextlib.closing(client._stream(call)) as chunks:
            for chunk in chunks:
                yield from self._decoder.feed(chunk)
                if self.finished:
                    return
        yield from self._decoder.end()

    def __iter__(self) -> ExecStream:
        return self

    def __next__(self) -> Output:
        return next(self._output)

    def close(self) -> None:
        self._output.close()

    def __enter__(self) -> ExecStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def collect(
    stream: ExecStream, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
) -> ExecResult:
    """A command's whole run off its stream, each piece also passed to the callbacks."""
    collector = OutputCollector(on_stdout, on_stderr)
    with stream:
        for name, data in stream:
            collector.add(name, data)
    return collector.result(stream.result)


class Processes:
    """The processes of one sandbox (`sandbox.processes`), named by pid, tag or ProcessInfo.

    A background process (`start`, or `exec_stream(..., background=True)`) outlives the
    stream that started it, keeps its latest 1 MiB of output for the next `connect`, and
    stays listed with its result for a while once it ended."""

    def __init__(self, client: Space, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def start(self, command: str | Sequence[str], **options: Unpack[ExecOptions]) -> ProcessInfo:
        """Starts `command` in the background and answers at once; `tag` names it."""
        return self._client._call(calls.start_process(self._id, command, options))

    def list(self) -> builtins.list[ProcessInfo]:
        return self._client._call(calls.processes(self._id))

    def get(self, ref: ProcessRef) -> ProcessInfo:
        return self._client._call(calls.process(self._id, ref))

    def connect(self, ref: ProcessRef, *, replay: bool = True) -> ExecStream:
        """Follows the process: the output it kept first (unless `replay` is False), then as
        it comes, then `result`. Closing the stream leaves the process running."""
        return ExecStream(self._client, calls.process_output(self._id, ref, replay))

    def wait(
        self,
        ref: ProcessRef,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Until the process ends: its result, with the output kept and produced meanwhile."""
        return collect(self.connect(ref), on_stdout, on_stderr)

    def send_stdin(self, ref: ProcessRef, data: bytes | str, *, eof: bool = False) -> None:
        """Input for a process started with `keep_stdin` (or a PTY); `eof` closes it after."""
        raw = data.encode() if isinstance(data, str) else data
        self._client._call(calls.process_stdin(self._id, ref, eof), raw)

    def close_stdin(self, ref: ProcessRef) -> None:
        self.send_stdin(ref, b"", eof=True)

    def signal(self, ref: ProcessRef, signum: int) -> None:
        """`signum` to the process's whole group."""
        self._client._call(calls.signal_process(self._id, ref, signum))

    def resize(self, ref: ProcessRef, rows: int, cols: int) -> None:
        self._client._call(calls.resize_process(self._id, ref, rows, cols))

    def kill(self, ref: ProcessRef) -> None:
        self._client._call(calls.kill_process(self._id, ref))


class Files:
    """The files of one sandbox (`sandbox.files`). Paths are absolute paths inside it."""

    def __init__(self, client: Space, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    def read(self, path: str) -> bytes:
        return self._client._call(calls.read_file(self._id, path))

    def iter(self, path: str) -> Iterator[bytes]:
        """The file's contents in chunks, as they arrive (close the iterator if you stop early)."""
        return self._client._stream(calls.read_file(self._id, path))

    def write(
        self, path: str, data: Upload, *, mode: int | None = None, make_parents: bool = False
    ) -> int:
        """Writes bytes, text (UTF-8), a binary file object or an iterable of bytes to `path`,
        streamed; the file appears whole or not at all. Answers the size written."""
        call = calls.write_file(self._id, path, mode, make_parents)
        return self._client._call(call, calls.upload_content(data))

    def list(self, path: str) -> builtins.list[FileEntry]:
        return self._client._call(calls.list_files(self._id, path))

    def stat(self, path: str) -> FileEntry:
        return self._client._call(calls.stat(self._id, path))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._client._call(calls.remove(self._id, path, recursive))

    def rename(self, path: str, to: str, *, overwrite: bool = False) -> FileEntry:
        """`path` becomes `to` in one step; an existing `to` is replaced only with `overwrite`
        (ConflictError otherwise)."""
        return self._client._call(calls.rename(self._id, path, to, overwrite))

    def mkdir(self, path: str, *, parents: bool = False) -> FileEntry:
        return self._client._call(calls.mkdir(self._id, path, parents))

    def watch(self, path: str, *, recursive: bool = False) -> FileWatch:
        """Changes in directory `path` (and under it if `recursive`) as FileEvents; the watch
        is set when this returns. Close it to stop."""
        return FileWatch(self._client, calls.watch(self._id, path, recursive))


class Sandbox(SandboxBase[Space]):
    """One sandbox. Make one with `create`, find them with `get` and `list`; `with` deletes it
    at the end of the block. `info` is the API's latest description of it."""

    def __init__(self, client: Space, info: SandboxInfo) -> None:
        super().__init__(client, info)
        self.files = Files(client, info.id)
        self.processes = Processes(client, info.id)
        self.pty = Pty(self.processes)

    @classmethod
    def create(cls, *, client: Space | None = None, **options: Unpack[CreateOptions]) -> Sandbox:
        """A new sandbox, answered once it is running (unless `wait=False`)."""
        client = client or _default_client()
        return cls(client, client._call(calls.create(options)))

    @classmethod
    def get(cls, sandbox_id: str, *, client: Space | None = None) -> Sandbox:
        client = client or _default_client()
        return cls(client, client._call(calls.get(sandbox_id)))

    @classmethod
    def list(
        cls, *, client: Space | None = None, **filters: Unpack[ListFilters]
    ) -> Iterator[Sandbox]:
        """Every sandbox that matches, newest first, fetched page by page as iteration goes."""
        client = client or _default_client()
        pages = calls.Pages(filters)
        while (call := pages.next_call()) is not None:
            yield from (cls(client, info) for info in client._call(call))

    def _update(self, call: Call[SandboxInfo]) -> SandboxInfo:
        self.info = self._client._call(call)
        return self.info

    def refresh(self) -> SandboxInfo:
        return self._update(calls.get(self.id))

    def pause(self) -> SandboxInfo:
        return self._update(calls.lifecycle(self.id, "pause"))

    def resume(self) -> SandboxInfo:
        return self._update(calls.lifecycle(self.id, "resume"))

    def suspend(self) -> SandboxInfo:
        return self._update(calls.lifecycle(self.id, "suspend"))

    def delete(self) -> SandboxInfo:
        return self._update(calls.delete(self.id))

    def set_timeout(self, timeout_s: int) -> SandboxInfo:
        """Moves the deadline to now + `timeout_s`."""
        return self._update(calls.set_timeout(self.id, timeout_s))

    def events(self) -> builtins.list[Event]:
        return self._client._call(calls.events(self.id))

    def set_network(self, network: Mapping[str, Any] | None) -> SandboxInfo:
        """A new egress policy (`{"default": "deny", "hosts": [{"pattern": "pypi.org"}]}`; None:
        the deployment's default), in force at once."""
        return self._update(calls.set_network(self.id, network))

    def logs(self, tail: int = 65536, follow: bool = False) -> Iterator[str]:
        """Its serial console, as text: the last `tail` bytes of the guest kernel's and its
        agent's messages (and whatever the guest writes to /dev/console), then, with `follow`,
        what comes until its VM stops or you stop reading."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for chunk in self._client._stream(calls.logs(self.id, tail, follow)):
            if text := decoder.decode(chunk):
                yield text

    def audit(self, after: int = 0) -> builtins.list[AuditEvent]:
        """Its gateway's decisions on its egress, oldest first, those numbered after `after`."""
        return self._client._call(calls.audit(self.id, after))

    def link(self, port: int, expires_in_s: int = 3600) -> PreviewLink:
        """A link to `port` at the sandbox's preview host (`{port}-{sandbox}.{domain}`) that
        opens it in a browser with no key, for `expires_in_s` (at most a week); whoever holds
        it can use it until then."""
        return self._client._call(calls.link(self.id, port, expires_in_s))

    def request(
        self, port: int, method: str = "GET", path: str = "/", **options: Unpack[RequestOptions]
    ) -> httpx.Response:
        """One HTTP request to the service on `port` inside the sandbox, through the API (the
        only way in), and its whole answer, whatever its status. The API's own refusals raise:
        NotFoundError, or APIError 502 when nothing listens there, 504 when nothing answers."""
        with transport_errors(self._client.base_url):
            url = calls.port_path(self.id, port, path)
            return self._client._http.request(method, url, **options)

    def checkpoint(self, name: str = "") -> CheckpointInfo:
        """Memory and disk as they are now (volumes left out), taken while it runs on."""
        return self._client._call(calls.checkpoint(self.id, name))

    def checkpoints(self) -> builtins.list[CheckpointInfo]:
        return self._client._call(calls.checkpoints(self.id))

    def delete_checkpoint(self, checkpoint: str | CheckpointInfo) -> None:
        self._client._call(calls.delete_checkpoint(self.id, checkpoint_id_of(checkpoint)))

    def rollback(self, checkpoint: str | CheckpointInfo) -> SandboxInfo:
        """Back to a checkpoint in place: its processes and files as they were then."""
        return self._update(calls.rollback(self.id, checkpoint_id_of(checkpoint)))

    def fork(
        self,
        count: int = 1,
        *,
        checkpoint: str | CheckpointInfo | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> builtins.list[Sandbox]:
        """`count` running children of its state now (or of `checkpoint`), each a sandbox of its
        own; `env` goes over the parent's. This sandbox runs on."""
        ck = checkpoint_id_of(checkpoint) if checkpoint is not None else None
        infos = self._client._call(calls.fork(self.id, count, ck, env, metadata))
        return [Sandbox(self._client, info) for info in infos]

    def exec_stream(
        self, command: str | Sequence[str], **options: Unpack[ExecOptions]
    ) -> ExecStream:
        """Runs `command` (a string goes through `/bin/sh -c`, a sequence is the argv) and
        streams its output; see `ExecStream`."""
        return ExecStream(self._client, calls.exec_(self.id, command, options))

    def exec(
        self,
        command: str | Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """Runs `command` to its end; the result holds its whole output, which is also passed
        to the callbacks piece by piece as it comes."""
        return collect(self.exec_stream(command, **options), on_stdout, on_stderr)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):
            self.delete()

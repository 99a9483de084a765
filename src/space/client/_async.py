"""The asynchronous SDK: `AsyncSpace` (a connection to the API) and `AsyncSandbox` (one
sandbox), over httpx.AsyncClient. Requests and answers come from `_calls`; this module only
sends them."""

from __future__ import annotations

import asyncio
import builtins
import codecs
import contextlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Iterable,
    Mapping,
    Sequence,
)
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
from space.client._pty import AsyncPty
from space.client._watch import AsyncFileWatch

T = TypeVar("T")

AsyncUpload = Upload | AsyncIterable[bytes]


async def _raise_for_error(response: httpx.Response) -> None:
    if response.is_error and not calls.from_the_service(response):
        await response.aread()
        raise error_from_response(response)


class AsyncSpace:
    """A connection to a SPACE API server, for asyncio: the arguments are those of `Space`.
    `aclose()` it (or use `async with`) to release its connections."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = calls.DEFAULT_TIMEOUT,
    ) -> None:
        self._http = calls.http_client(
            httpx.AsyncClient, base_url, api_key, timeout, _raise_for_error
        )

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSpace:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def create_volume(self, size_mib: int = 1024, name: str = "") -> VolumeInfo:
        """An empty volume to attach at sandbox create (`volumes=[{"volume": id, "path": …}]`)."""
        return await self._call(calls.create_volume(name, size_mib))

    async def volumes(self) -> list[VolumeInfo]:
        return await self._call(calls.volumes())

    async def delete_volume(self, volume_id: str) -> VolumeInfo:
        """Deletes its data; refused while a sandbox that is not deleted has it."""
        return await self._call(calls.delete_volume(volume_id))

    async def audit_log(
        self, after: int = 0, limit: int = 100, **filters: Unpack[calls.AuditFilters]
    ) -> list[AuditRecord]:
        """The control plane's audit log, oldest first, from the entry after id `after`: the
        tenant's own entries (an admin key's: everyone's, or `tenant`'s)."""
        return await self._call(calls.audit_log(after, limit, filters))

    async def usage(
        self, step: str = "1h", by: str = "total", **filters: Unpack[calls.UsageFilters]
    ) -> Usage:
        """What sandboxes and volumes were given and used, a point per `step` ("60s", "1h",
        "1d"), as a whole or `by` tenant, sandbox, template or "label:KEY": the tenant's own
        (an admin key's: everyone's, or `tenant`'s)."""
        return await self._call(calls.usage(step, by, filters))

    async def usage_hosts(
        self, limit: int = 100, **filters: Unpack[calls.UsageFilters]
    ) -> list[HostUsage]:
        """The hosts sandboxes' gateways sent most to, with the bytes each way."""
        return await self._call(calls.usage_hosts(limit, filters))

    async def set_secret(self, name: str, value: str) -> SecretInfo:
        """Create or replace a secret (sealed at rest); bind it to a sandbox's hosts with
        `secrets=[{"secret": name, "hosts": [...], "env": "VAR"}]` at create."""
        return await self._call(calls.set_secret(name, value))

    async def secrets(self) -> list[SecretInfo]:
        """The tenant's secrets, by name: never a value."""
        return await self._call(calls.secrets())

    async def delete_secret(self, name: str) -> None:
        """Refused (ConflictError) while a sandbox that is not deleted has it bound."""
        await self._call(calls.delete_secret(name))

    async def template(self, name: str) -> TemplateInfo:
        return await self._call(calls.template(name))

    async def build_template(
        self, name: str, spec: str | Path, environ: Mapping[str, str] | None = None
    ) -> TemplateInfo:
        """Start building `name` from a space.toml (admin keys only); `environ` gives the values
        of the variables it names for registry credentials. Follow it with `build_log`."""
        return await self._call(calls.build_template(name, Path(spec), environ or {}))

    async def build_from_dockerfile(
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
        return await self._call(call)

    async def template_from_checkpoint(
        self, name: str, sandbox_id: str, checkpoint: str | CheckpointInfo
    ) -> TemplateInfo:
        """Start making template `name` of one of your checkpoints (admin keys only): its disk,
        and its memory with the processes running, so sandboxes of it start as it was, in its
        shape. Follow it with `build_log`."""
        return await self._call(
            calls.template_from_checkpoint(name, sandbox_id, checkpoint_id_of(checkpoint))
        )

    async def build_log(self, name: str) -> AsyncIterator[str]:
        """The lines of the template's last build log, as they come, until the build ends."""
        buf = b""
        async for chunk in self._stream(calls.build_log(name)):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                yield line.decode(errors="replace")

    async def delete_template(self, name: str) -> TemplateInfo:
        """Refused while a sandbox uses it (admin keys only)."""
        return await self._call(calls.delete_template(name))

    async def templates(self) -> list[TemplateInfo]:
        """Every template, with the state of its warm pool."""
        return await self._call(calls.templates())

    async def set_pool(
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
        return await self._call(calls.set_pool(template, size, vcpus, memory_mib, disk_mib))

    async def _call(self, call: Call[T], content: bytes | AsyncIterable[bytes] | None = None) -> T:
        with transport_errors(self.base_url):
            return call.answer(await self._http.send(call.request(self._http, content)))

    async def _stream(self, call: Call[Any]) -> AsyncGenerator[bytes]:
        with transport_errors(self.base_url):
            response = await self._http.send(call.request(self._http), stream=True)
            try:
                async for chunk in response.aiter_bytes():
                    yield chunk
            finally:
                await response.aclose()


# An httpx.AsyncClient's connections belong to the event loop that opened them, so sandboxes
# made without a client share one per loop.
_defaults: dict[asyncio.AbstractEventLoop, AsyncSpace] = {}


def _default_client() -> AsyncSpace:
    """The client of sandboxes made without one, configured from the environment."""
    for loop in [loop for loop in _defaults if loop.is_closed()]:
        del _defaults[loop]
    loop = asyncio.get_running_loop()
    if loop not in _defaults:
        _defaults[loop] = AsyncSpace()
    return _defaults[loop]


async def _async_chunks(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterable (a local file, say) read off the event loop."""
    iterator = iter(chunks)
    while (chunk := await asyncio.to_thread(next, iterator, None)) is not None:
        yield chunk


def _async_content(data: AsyncUpload) -> bytes | AsyncIterable[bytes]:
    if isinstance(data, AsyncIterable):
        return data
    content = calls.upload_content(data)
    return content if isinstance(content, bytes) else _async_chunks(content)


class AsyncExecStream(ExecStreamBase):
    """A running command: `async for` it for `("stdout" | "stderr", bytes)` as the output
    comes, then read `result`. `aclose()` (or leaving its `async with` block) stops reading."""

    def __init__(self, client: AsyncSpace, call: Call[None]) -> None:
        super().__init__()
        self._output = self._read(client, call)

    async def _read(self, client: AsyncSpace, call: Call[None]) -> AsyncGenerator[Output]:
        async with contextlib.aclosing(client._stream(call)) as chunks:
            async for chunk in chunks:
                for item in self._decoder.feed(chunk):
                    yield item
                if self.finished:
                    return
        for item in self._decoder.end():
            yield item

    def __aiter__(self) -> AsyncExecStream:
        return self

    async def __anext__(self) -> Output:
        return await anext(self._output)

    async def aclose(self) -> None:
        await self._output.aclose()

    async def __aenter__(self) -> AsyncExecStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def collect(
    stream: AsyncExecStream, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None
) -> ExecResult:
    """A command's whole run off its stream, each piece also passed to the callbacks."""
    collector = OutputCollector(on_stdout, on_stderr)
    async with stream:
        async for name, data in stream:
            collector.add(name, data)
    return collector.result(stream.result)


class AsyncProcesses:
    """The processes of one sandbox (`sandbox.processes`), named by pid, tag or ProcessInfo;
    see `space.Processes`."""

    def __init__(self, client: AsyncSpace, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def start(
        self, command: str | Sequence[str], **options: Unpack[ExecOptions]
    ) -> ProcessInfo:
        """Starts `command` in the background and answers at once; `tag` names it."""
        return await self._client._call(calls.start_process(self._id, command, options))

    async def list(self) -> builtins.list[ProcessInfo]:
        return await self._client._call(calls.processes(self._id))

    async def get(self, ref: ProcessRef) -> ProcessInfo:
        return await self._client._call(calls.process(self._id, ref))

    def connect(self, ref: ProcessRef, *, replay: bool = True) -> AsyncExecStream:
        """Follows the process: the output it kept first (unless `replay` is False), then as
        it comes, then `result`. Closing the stream leaves the process running."""
        return AsyncExecStream(self._client, calls.process_output(self._id, ref, replay))

    async def wait(
        self,
        ref: ProcessRef,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
    ) -> ExecResult:
        """Until the process ends: its result, with the output kept and produced meanwhile."""
        return await collect(self.connect(ref), on_stdout, on_stderr)

    async def send_stdin(self, ref: ProcessRef, data: bytes | str, *, eof: bool = False) -> None:
        """Input for a process started with `keep_stdin` (or a PTY); `eof` closes it after."""
        raw = data.encode() if isinstance(data, str) else data
        await self._client._call(calls.process_stdin(self._id, ref, eof), raw)

    async def close_stdin(self, ref: ProcessRef) -> None:
        await self.send_stdin(ref, b"", eof=True)

    async def signal(self, ref: ProcessRef, signum: int) -> None:
        """`signum` to the process's whole group."""
        await self._client._call(calls.signal_process(self._id, ref, signum))

    async def resize(self, ref: ProcessRef, rows: int, cols: int) -> None:
        await self._client._call(calls.resize_process(self._id, ref, rows, cols))

    async def kill(self, ref: ProcessRef) -> None:
        await self._client._call(calls.kill_process(self._id, ref))


class AsyncFiles:
    """The files of one sandbox (`sandbox.files`). Paths are absolute paths inside it."""

    def __init__(self, client: AsyncSpace, sandbox_id: str) -> None:
        self._client = client
        self._id = sandbox_id

    async def read(self, path: str) -> bytes:
        return await self._client._call(calls.read_file(self._id, path))

    def iter(self, path: str) -> AsyncIterator[bytes]:
        """The file's contents in chunks, as they arrive (close the iterator if you stop early)."""
        return self._client._stream(calls.read_file(self._id, path))

    async def write(
        self, path: str, data: AsyncUpload, *, mode: int | None = None, make_parents: bool = False
    ) -> int:
        """Writes bytes, text (UTF-8), a binary file object or an (async) iterable of bytes to
        `path`, streamed; the file appears whole or not at all. Answers the size written."""
        call = calls.write_file(self._id, path, mode, make_parents)
        return await self._client._call(call, _async_content(data))

    async def list(self, path: str) -> builtins.list[FileEntry]:
        return await self._client._call(calls.list_files(self._id, path))

    async def stat(self, path: str) -> FileEntry:
        return await self._client._call(calls.stat(self._id, path))

    async def remove(self, path: str, *, recursive: bool = False) -> None:
        await self._client._call(calls.remove(self._id, path, recursive))

    async def rename(self, path: str, to: str, *, overwrite: bool = False) -> FileEntry:
        """`path` becomes `to` in one step; an existing `to` is replaced only with `overwrite`
        (ConflictError otherwise)."""
        return await self._client._call(calls.rename(self._id, path, to, overwrite))

    async def mkdir(self, path: str, *, parents: bool = False) -> FileEntry:
        return await self._client._call(calls.mkdir(self._id, path, parents))

    async def watch(self, path: str, *, recursive: bool = False) -> AsyncFileWatch:
        """Changes in directory `path` (and under it if `recursive`) as FileEvents; the watch
        is set when this returns. Close it to stop."""
        return await AsyncFileWatch(self._client, calls.watch(self._id, path, recursive)).start()


class AsyncSandbox(SandboxBase[AsyncSpace]):
    """One sandbox. Make one with `create`, find them with `get` and `list`; `async with`
    deletes it at the end of the block. `info` is the API's latest description of it."""

    def __init__(self, client: AsyncSpace, info: SandboxInfo) -> None:
        super().__init__(client, info)
        self.files = AsyncFiles(client, info.id)
        self.processes = AsyncProcesses(client, info.id)
        self.pty = AsyncPty(self.processes)

    @classmethod
    async def create(
        cls, *, client: AsyncSpace | None = None, **options: Unpack[CreateOptions]
    ) -> AsyncSandbox:
        """A new sandbox, answered once it is running (unless `wait=False`)."""
        client = client or _default_client()
        return cls(client, await client._call(calls.create(options)))

    @classmethod
    async def get(cls, sandbox_id: str, *, client: AsyncSpace | None = None) -> AsyncSandbox:
        client = client or _default_client()
        return cls(client, await client._call(calls.get(sandbox_id)))

    @classmethod
    async def list(
        cls, *, client: AsyncSpace | None = None, **filters: Unpack[ListFilters]
    ) -> AsyncIterator[AsyncSandbox]:
        """Every sandbox that matches, newest first, fetched page by page as iteration goes."""
        client = client or _default_client()
        pages = calls.Pages(filters)
        while (call := pages.next_call()) is not None:
            for info in await client._call(call):
                yield cls(client, info)

    async def _update(self, call: Call[SandboxInfo]) -> SandboxInfo:
        self.info = await self._client._call(call)
        return self.info

    async def refresh(self) -> SandboxInfo:
        return await self._update(calls.get(self.id))

    async def pause(self) -> SandboxInfo:
        return await self._update(calls.lifecycle(self.id, "pause"))

    async def resume(self) -> SandboxInfo:
        return await self._update(calls.lifecycle(self.id, "resume"))

    async def suspend(self) -> SandboxInfo:
        return await self._update(calls.lifecycle(self.id, "suspend"))

    async def delete(self) -> SandboxInfo:
        return await self._update(calls.delete(self.id))

    async def set_timeout(self, timeout_s: int) -> SandboxInfo:
        """Moves the deadline to now + `timeout_s`."""
        return await self._update(calls.set_timeout(self.id, timeout_s))

    async def events(self) -> builtins.list[Event]:
        return await self._client._call(calls.events(self.id))

    async def set_network(self, network: Mapping[str, Any] | None) -> SandboxInfo:
        """A new egress policy (`{"default": "deny", "hosts": [{"pattern": "pypi.org"}]}`; None:
        the deployment's default), in force at once."""
        return await self._update(calls.set_network(self.id, network))

    async def logs(self, tail: int = 65536, follow: bool = False) -> AsyncIterator[str]:
        """Its serial console, as text: the last `tail` bytes of the guest kernel's and its
        agent's messages (and whatever the guest writes to /dev/console), then, with `follow`,
        what comes until its VM stops or you stop reading."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        async for chunk in self._client._stream(calls.logs(self.id, tail, follow)):
            if text := decoder.decode(chunk):
                yield text

    async def audit(self, after: int = 0) -> builtins.list[AuditEvent]:
        """Its gateway's decisions on its egress, oldest first, those numbered after `after`."""
        return await self._client._call(calls.audit(self.id, after))

    async def link(self, port: int, expires_in_s: int = 3600) -> PreviewLink:
        """A link to `port` at the sandbox's preview host (`{port}-{sandbox}.{domain}`) that
        opens it in a browser with no key, for `expires_in_s` (at most a week); whoever holds
        it can use it until then."""
        return await self._client._call(calls.link(self.id, port, expires_in_s))

    async def request(
        self, port: int, method: str = "GET", path: str = "/", **options: Unpack[RequestOptions]
    ) -> httpx.Response:
        """One HTTP request to the service on `port` inside the sandbox; see
        `space.Sandbox.request`."""
        with transport_errors(self._client.base_url):
            url = calls.port_path(self.id, port, path)
            return await self._client._http.request(method, url, **options)

    async def checkpoint(self, name: str = "") -> CheckpointInfo:
        """Memory and disk as they are now (volumes left out), taken while it runs on."""
        return await self._client._call(calls.checkpoint(self.id, name))

    async def checkpoints(self) -> builtins.list[CheckpointInfo]:
        return await self._client._call(calls.checkpoints(self.id))

    async def delete_checkpoint(self, checkpoint: str | CheckpointInfo) -> None:
        await self._client._call(calls.delete_checkpoint(self.id, checkpoint_id_of(checkpoint)))

    async def rollback(self, checkpoint: str | CheckpointInfo) -> SandboxInfo:
        """Back to a checkpoint in place: its processes and files as they were then."""
        return await self._update(calls.rollback(self.id, checkpoint_id_of(checkpoint)))

    async def fork(
        self,
        count: int = 1,
        *,
        checkpoint: str | CheckpointInfo | None = None,
        env: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> builtins.list[AsyncSandbox]:
        """`count` running children of its state now (or of `checkpoint`), each a sandbox of its
        own; `env` goes over the parent's. This sandbox runs on."""
        ck = checkpoint_id_of(checkpoint) if checkpoint is not None else None
        infos = await self._client._call(calls.fork(self.id, count, ck, env, metadata))
        return [AsyncSandbox(self._client, info) for info in infos]

    def exec_stream(
        self, command: str | Sequence[str], **options: Unpack[ExecOptions]
    ) -> AsyncExecStream:
        """Runs `command` (a string goes through `/bin/sh -c`, a sequence is the argv) and
        streams its output; see `AsyncExecStream`."""
        return AsyncExecStream(self._client, calls.exec_(self.id, command, options))

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        **options: Unpack[ExecOptions],
    ) -> ExecResult:
        """Runs `command` to its end; the result holds its whole output, which is also passed
        to the callbacks piece by piece as it comes."""
        return await collect(self.exec_stream(command, **options), on_stdout, on_stderr)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with contextlib.suppress(NotFoundError):
            await self.delete()

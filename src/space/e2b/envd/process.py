"""envd's Process service on SPACE's background processes: every process an E2B SDK starts
outlives the stream that started it (as under E2B's daemon), is named by its pid or its tag,
and is followed, fed, signalled and resized through its worker."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from protobuf import Oneof
from pydantic import ValidationError

from space.api.deps import Services
from space.api.errors import validation_detail
from space.api.schemas import ExecRequest as PublicExecRequest
from space.e2b.envd.target import Target, code_for, errors, keepalive_s, oneof, paced, resolve
from space.e2b.proto.process.process_connect import Process
from space.e2b.proto.process.process_pb import (
    CloseStdinRequest,
    CloseStdinResponse,
    ConnectRequest,
    ConnectResponse,
    ListRequest,
    ListResponse,
    ProcessConfig,
    ProcessEvent,
    ProcessInfo,
    ProcessInput,
    ProcessSelector,
    SendInputRequest,
    SendInputResponse,
    SendSignalRequest,
    SendSignalResponse,
    Signal,
    StartRequest,
    StartResponse,
    StreamInputRequest,
    StreamInputResponse,
    UpdateRequest,
    UpdateResponse,
)
from space.worker.api.models import (
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStart,
    TerminalSize,
)
from space.worker.api.models import ProcessInfo as SpaceProcess

Event = ProcessEvent
KEEPALIVE = Event(event=oneof("keepalive", Event.KeepAlive()))
SIGNALS = {Signal.SIGKILL: 9, Signal.SIGTERM: 15}


def ref_of(selector: ProcessSelector | None) -> str:
    match selector.selector if selector is not None else None:
        case Oneof(field="pid", value=pid):
            return str(pid)
        case Oneof(field="tag", value=tag) if tag:
            return str(tag)
    raise ConnectError(Code.INVALID_ARGUMENT, "name the process by its pid or its tag")


def exec_request(target: Target, request: StartRequest, timeout_ms: float | None) -> ExecRequest:
    config = request.process or ProcessConfig()
    if not config.cmd:
        raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty")
    body: dict[str, Any] = {
        "argv": [config.cmd, *config.args],
        "env": dict(config.envs),
        # In the user's home unless told otherwise, as under E2B's daemon.
        "cwd": target.path(config.cwd if config.has_field("cwd") else ""),
        "user": target.user,
        "background": True,
        # Absent means an open stdin, as E2B's daemon has it.
        "keep_stdin": request.stdin if request.has_field("stdin") else True,
        # The call's deadline is the process's, as under E2B's daemon.
        "timeout": timeout_ms / 1000 if timeout_ms else None,
        "tag": request.tag if request.has_field("tag") else None,
    }
    if request.has_field("pty") and request.pty is not None:
        size = request.pty.size
        body.update(pty=True, rows=(size.rows if size else 0) or 24,
                    cols=(size.cols if size else 0) or 80)  # fmt: skip
    try:
        public = PublicExecRequest.model_validate({k: v for k, v in body.items() if v is not None})
        return ExecRequest.model_validate(public.model_dump(exclude_none=True))
    except ValidationError as e:
        detail = validation_detail(e.errors())
        raise ConnectError(Code.INVALID_ARGUMENT, detail) from None


def ended(done: ExecExit) -> Event:
    if done.exit_code is not None:
        end = Event.EndEvent(exit_code=done.exit_code, exited=True,
                             status=f"exit status {done.exit_code}")  # fmt: skip
    else:
        end = Event.EndEvent(exit_code=-1, exited=False, status=f"signal: {done.signal}")
    if done.timed_out:
        end.error = "the process outlived its call's deadline and was killed"
    return Event(event=oneof("end", end))


def info_of(p: SpaceProcess) -> ProcessInfo:
    argv = p.argv or ["/bin/sh", "-c", p.cmd or ""]
    config = ProcessConfig(cmd=argv[0], args=argv[1:])
    if p.cwd:
        config.cwd = p.cwd
    info = ProcessInfo(config=config, pid=p.pid)
    if p.tag:
        info.tag = p.tag
    return info


def _bytes(given: ProcessInput | None) -> bytes:
    """What a ProcessInput carries, for stdin or for the terminal alike."""
    return bytes(given.input.value) if given is not None and given.input is not None else b""


class ProcessService(Process):
    def __init__(self, services: Callable[[], Services]) -> None:
        self.services = services

    async def _target(self, ctx: RequestContext[Any, Any]) -> Target:
        return await resolve(self.services(), ctx.request_headers)

    async def _follow(
        self,
        ctx: RequestContext[Any, Any],
        opened: AbstractAsyncContextManager[AsyncIterator[ExecEvent]],
        pty: bool,
    ) -> AsyncIterator[Event]:
        """The process's start, then its output as it comes, then its end."""
        started = False
        with errors():
            async with contextlib.AsyncExitStack() as stack:
                events = await stack.enter_async_context(opened)
                paced_ = paced(events, keepalive_s(ctx.request_headers))
                async for ev in await stack.enter_async_context(contextlib.aclosing(paced_)):
                    if ev is None:
                        if started:  # the SDKs take the first event for the start
                            yield KEEPALIVE
                    elif isinstance(ev, ExecStart):
                        started = True
                        yield Event(event=oneof("start", Event.StartEvent(pid=ev.pid)))
                    elif isinstance(ev, ExecOutput):
                        output = oneof("pty" if pty else ev.type, ev.raw)
                        yield Event(event=oneof("data", Event.DataEvent(output=output)))
                    elif isinstance(ev, ExecExit):
                        yield ended(ev)
                        return
                    else:
                        raise ConnectError(code_for(ev.status or 502), ev.message)

    async def start(
        self, request: StartRequest, ctx: RequestContext[StartRequest, StartResponse]
    ) -> AsyncIterator[StartResponse]:
        """Started in the background and followed in one call to its worker: the process
        outlives this stream, as under E2B's daemon."""
        t = await self._target(ctx)
        req = exec_request(t, request, ctx.timeout_ms)
        opened = t.svc.workers.exec_events(t.worker, t.sandbox_id, req)
        async for ev in self._follow(ctx, opened, pty=req.pty):
            yield StartResponse(event=ev)

    async def connect(
        self, request: ConnectRequest, ctx: RequestContext[ConnectRequest, ConnectResponse]
    ) -> AsyncIterator[ConnectResponse]:
        t = await self._target(ctx)
        with errors():
            p = await t.svc.workers.process(t.worker, t.sandbox_id, ref_of(request.process))
        if not p.running:
            raise ConnectError(Code.NOT_FOUND, f"process {p.pid} is not running")
        opened = t.svc.workers.process_events(t.worker, t.sandbox_id, str(p.pid), replay=False)
        async for ev in self._follow(ctx, opened, pty=p.pty):
            yield ConnectResponse(event=ev)

    async def list(
        self, request: ListRequest, ctx: RequestContext[ListRequest, ListResponse]
    ) -> ListResponse:
        t = await self._target(ctx)
        with errors():
            found = await t.svc.workers.processes(t.worker, t.sandbox_id)
        return ListResponse(processes=[info_of(p) for p in found.processes if p.running])

    async def send_input(
        self, request: SendInputRequest, ctx: RequestContext[SendInputRequest, SendInputResponse]
    ) -> SendInputResponse:
        t = await self._target(ctx)
        with errors():
            await t.svc.workers.process_stdin(
                t.worker, t.sandbox_id, ref_of(request.process), _bytes(request.input)
            )
        return SendInputResponse()

    async def stream_input(
        self,
        request: AsyncIterator[StreamInputRequest],
        ctx: RequestContext[StreamInputRequest, StreamInputResponse],
    ) -> StreamInputResponse:
        t = await self._target(ctx)
        ref = None
        async for message in request:
            event = message.event.value if message.event else None
            if isinstance(event, StreamInputRequest.StartEvent):
                ref = ref_of(event.process)
            elif (
                isinstance(event, StreamInputRequest.DataEvent)
                and event.input
                and event.input.input
            ):
                if ref is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "data came before start")
                with errors():
                    await t.svc.workers.process_stdin(
                        t.worker, t.sandbox_id, ref, _bytes(event.input)
                    )
        return StreamInputResponse()

    async def send_signal(
        self, request: SendSignalRequest, ctx: RequestContext[SendSignalRequest, SendSignalResponse]
    ) -> SendSignalResponse:
        t = await self._target(ctx)
        number = SIGNALS.get(request.signal)
        if number is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal is SIGKILL or SIGTERM")
        ref = ref_of(request.process)
        with errors():
            p = await t.svc.workers.process(t.worker, t.sandbox_id, ref)
            if not p.running:  # a kill of what ended finds nothing, as under E2B
                raise ConnectError(Code.NOT_FOUND, f"process {p.pid} is not running")
            await t.svc.workers.signal_process(t.worker, t.sandbox_id, ref, number)
        return SendSignalResponse()

    async def close_stdin(
        self, request: CloseStdinRequest, ctx: RequestContext[CloseStdinRequest, CloseStdinResponse]
    ) -> CloseStdinResponse:
        t = await self._target(ctx)
        with errors():
            await t.svc.workers.process_stdin(
                t.worker, t.sandbox_id, ref_of(request.process), b"", eof=True
            )
        return CloseStdinResponse()

    async def update(
        self, request: UpdateRequest, ctx: RequestContext[UpdateRequest, UpdateResponse]
    ) -> UpdateResponse:
        t = await self._target(ctx)
        size = request.pty.size if request.pty else None
        if size is None:
            return UpdateResponse()
        try:
            wanted = TerminalSize(rows=size.rows, cols=size.cols)
        except ValidationError:
            raise ConnectError(Code.INVALID_ARGUMENT, "rows and cols are 1 to 1000") from None
        with errors():
            await t.svc.workers.resize_process(
                t.worker, t.sandbox_id, ref_of(request.process), wanted
            )
        return UpdateResponse()

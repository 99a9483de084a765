"""A sandbox's processes through the API, relayed to its worker: start one in the background,
list them, follow one (NDJSON or WebSocket), give it input, signal it, resize its terminal. A
process is named by its pid or by the tag it was started with."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request, WebSocket
from fastapi.responses import Response, StreamingResponse

from space.api.data import relay, relay_ws, target
from space.api.deps import Caller, Svc
from space.api.schemas import ExecRequest as PublicExecRequest
from space.worker.api.models import (
    NDJSON,
    ExecRequest,
    ProcessInfo,
    ProcessList,
    ProcessSignal,
    TerminalSize,
)

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}/processes", tags=["processes"])

REF = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$")  # a pid or a tag: one path segment
Ref = Annotated[str, Path(pattern=REF.pattern, description="the pid, or the tag")]


@router.post("", response_model=ProcessInfo, status_code=201)
async def start(sandbox_id: str, body: PublicExecRequest, svc: Svc, caller: Caller) -> ProcessInfo:
    """Start a background process and answer at once; `stdin` is written to it, and closed
    unless `keep_stdin`. A PTY (`pty`, `rows`, `cols`) is fine here: follow it over
    `/processes/{ref}/ws`."""
    worker = await target(svc, caller.id, sandbox_id)
    req = ExecRequest.model_validate(body.model_dump(exclude_none=True))
    return await svc.workers.start_process(worker, sandbox_id, req)


@router.get("", response_model=ProcessList)
async def list_processes(sandbox_id: str, svc: Svc, caller: Caller) -> ProcessList:
    """The processes started through the API that run, and the last 32 background ones that
    ended (with how)."""
    worker = await target(svc, caller.id, sandbox_id)
    return await svc.workers.processes(worker, sandbox_id)


@router.get("/{ref}", response_model=ProcessInfo)
async def get_process(sandbox_id: str, ref: Ref, svc: Svc, caller: Caller) -> ProcessInfo:
    worker = await target(svc, caller.id, sandbox_id)
    return await svc.workers.process(worker, sandbox_id, ref)


@router.get("/{ref}/output", response_class=StreamingResponse)
async def follow(
    sandbox_id: str,
    ref: Ref,
    svc: Svc,
    caller: Caller,
    replay: Annotated[bool, Query(description="the output kept while nobody followed")] = True,
) -> StreamingResponse:
    """Follow a process: NDJSON events as `/exec` answers them. A background process keeps its
    latest 1 MiB of output for this (`start` says how much was dropped before it); leaving the
    stream leaves the process running."""
    worker = await target(svc, caller.id, sandbox_id)
    return await relay(svc.workers.process_output(worker, sandbox_id, ref, replay), NDJSON)


@router.websocket("/{ref}/ws")
async def follow_ws(websocket: WebSocket, sandbox_id: str, ref: str, replay: bool = True) -> None:
    """As `/exec/ws` once started: binary stdin up, tagged output down, text controls."""
    if not REF.match(ref):
        await websocket.close(code=4400, reason="name a process by its pid or its tag")
        return
    await relay_ws(
        websocket, sandbox_id, lambda svc, w: svc.workers.process_ws(w, sandbox_id, ref, replay)
    )


@router.post("/{ref}/stdin", status_code=204)
async def send_stdin(
    sandbox_id: str,
    ref: Ref,
    request: Request,
    svc: Svc,
    caller: Caller,
    eof: Annotated[bool, Query(description="close its stdin after this input")] = False,
) -> Response:
    """The body's bytes (up to 16 MiB) to the process's stdin (it was started with
    `keep_stdin`, or has a PTY)."""
    data = await request.body()  # held to STDIN_BODY by the body limit
    worker = await target(svc, caller.id, sandbox_id)
    await svc.workers.process_stdin(worker, sandbox_id, ref, data, eof)
    return Response(status_code=204)


@router.post("/{ref}/signal", status_code=204)
async def signal_process(
    sandbox_id: str, ref: Ref, body: ProcessSignal, svc: Svc, caller: Caller
) -> Response:
    """A signal (its number) to the process's whole group."""
    worker = await target(svc, caller.id, sandbox_id)
    await svc.workers.signal_process(worker, sandbox_id, ref, body.signal)
    return Response(status_code=204)


@router.post("/{ref}/resize", status_code=204)
async def resize(
    sandbox_id: str, ref: Ref, body: TerminalSize, svc: Svc, caller: Caller
) -> Response:
    worker = await target(svc, caller.id, sandbox_id)
    await svc.workers.resize_process(worker, sandbox_id, ref, body)
    return Response(status_code=204)


@router.delete("/{ref}", status_code=204)
async def kill(sandbox_id: str, ref: Ref, svc: Svc, caller: Caller) -> Response:
    """SIGKILL to the process's group."""
    worker = await target(svc, caller.id, sandbox_id)
    await svc.workers.kill_process(worker, sandbox_id, ref)
    return Response(status_code=204)

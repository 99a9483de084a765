"""An interactive terminal on a sandbox, for `space shell`: a PTY over the exec WebSocket.

The local terminal goes raw, so every keystroke (Ctrl-C included) reaches the sandbox's PTY, and
window size changes follow as resize messages. The server's binary messages carry the output,
its text messages the start/exit/error events. httpx-ws is imported here only, so the rest of the
SDK does not pay for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import termios
import tty
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Unpack

import httpx_ws
import wsproto.events

from space.client import _calls as calls
from space.client._async import AsyncSpace
from space.client._calls import ExecOptions
from space.client._errors import (
    APIError,
    ConnectionError,
    SpaceError,
    error_from_problem,
    transport_errors,
)
from space.client._exec import ExecDecoder, ws_output
from space.client._models import ExecResult
from space.client._pty import DEFAULT_SHELL, DEFAULT_TERM

_Input = bytes | tuple[int, int] | None  # keystrokes, a new (rows, cols), or end of input


async def shell(
    client: AsyncSpace,
    sandbox_id: str,
    command: str | Sequence[str] | None = None,
    **options: Unpack[ExecOptions],
) -> ExecResult:
    """Runs `command` (default: a login shell) in a PTY, attached to this process's terminal,
    until it exits. Output is not collected: it went to the terminal."""
    cols, rows = shutil.get_terminal_size()
    env = {"TERM": os.environ.get("TERM", DEFAULT_TERM), **(options.get("env") or {})}
    body = calls.exec_body(
        command or DEFAULT_SHELL, {**options, "env": env, "pty": True, "rows": rows, "cols": cols}
    )
    decoder = ExecDecoder()
    with transport_errors(client.base_url), _websocket_errors():
        async with contextlib.AsyncExitStack() as stack:
            ws = await _connect(client, sandbox_id, stack)
            await ws.send_text(json.dumps(body))
            async with _terminal_attached(ws):
                while decoder.result is None:
                    message = await ws.receive()
                    if isinstance(message, wsproto.events.BytesMessage):
                        stream, data = ws_output(bytes(message.data))
                        out = sys.stdout if stream == "stdout" else sys.stderr
                        out.buffer.write(data)
                        out.flush()
                    elif isinstance(message, wsproto.events.TextMessage):
                        decoder.event(json.loads(message.data))
    return decoder.result


async def _connect(
    client: AsyncSpace, sandbox_id: str, stack: contextlib.AsyncExitStack
) -> httpx_ws.AsyncWebSocketSession:
    """The exec WebSocket. A refused upgrade says little (servers answer a bare 403 when the
    sandbox is missing or not running), so the sandbox itself is asked why."""
    connection = httpx_ws.aconnect_ws(
        calls.exec_ws_path(sandbox_id), client._http, session_class=httpx_ws.AsyncWebSocketSession
    )
    try:
        return await stack.enter_async_context(connection)
    except (APIError, httpx_ws.WebSocketUpgradeError) as refusal:
        info = await client._call(calls.get(sandbox_id))  # raises NotFoundError if it is gone
        if info.state != "running":
            detail = f"sandbox {sandbox_id} is {info.state}, not running (resume it first)"
            raise error_from_problem(409, {"detail": detail, "state": info.state}) from refusal
        raise


@contextlib.contextmanager
def _websocket_errors() -> Iterator[None]:
    try:
        yield
    except httpx_ws.WebSocketDisconnect as e:
        if 4000 <= e.code < 5000:
            # Close codes 4000 + an HTTP status carry the API's refusal after the upgrade.
            raise error_from_problem(e.code - 4000, {"detail": e.reason}) from e
        raise ConnectionError(
            f"the shell's connection closed before the command exited ({e.code} {e.reason})"
        ) from e
    except httpx_ws.WebSocketNetworkError as e:
        raise ConnectionError("the shell's connection broke") from e
    except httpx_ws.WebSocketUpgradeError as e:
        raise SpaceError(
            f"the API refused the WebSocket upgrade (HTTP {e.response.status_code}); "
            "a proxy in between may not pass WebSockets"
        ) from e


@contextlib.asynccontextmanager
async def _terminal_attached(ws: httpx_ws.AsyncWebSocketSession) -> AsyncIterator[None]:
    """Our stdin, raw, and our window size go to the sandbox while the block runs."""
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    # One queue keeps keystrokes and resizes in the order they happened.
    outbox: asyncio.Queue[_Input] = asyncio.Queue()

    def on_input() -> None:
        data = os.read(fd, 65536)
        if not data:
            loop.remove_reader(fd)
        outbox.put_nowait(data or None)

    def on_resize() -> None:
        cols, rows = shutil.get_terminal_size()
        outbox.put_nowait((rows, cols))

    async def forward() -> None:
        while True:
            item = await outbox.get()
            if item is None:
                await ws.send_text(json.dumps({"eof": True}))
            elif isinstance(item, tuple):
                await ws.send_text(json.dumps({"resize": list(item)}))
            else:
                await ws.send_bytes(item)

    saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    if saved is not None:
        tty.setraw(fd)
    try:
        loop.add_reader(fd, on_input)
    except PermissionError:
        # A regular file or /dev/null cannot be watched (epoll refuses it); it can be read whole.
        outbox.put_nowait(sys.stdin.buffer.read())
        outbox.put_nowait(None)
    loop.add_signal_handler(signal.SIGWINCH, on_resize)
    forwarder = asyncio.create_task(forward())
    try:
        yield
    finally:
        forwarder.cancel()
        await asyncio.gather(forwarder, return_exceptions=True)
        loop.remove_reader(fd)
        loop.remove_signal_handler(signal.SIGWINCH)
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)

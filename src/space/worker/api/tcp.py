"""A TCP connection to a port inside a guest, bridged onto a WebSocket (see `TCP_EOF` in
`space.worker.api.models` for the protocol): how ingress reaches a service a sandbox runs,
streamed both ways with the agent's backpressure, never buffered whole."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.websockets import WebSocket, WebSocketDisconnect

from space.worker.agent_client import AgentClient, AgentError, TcpStream
from space.worker.api.activity import Activity
from space.worker.api.models import TCP_EOF, TCP_FRAME, TCP_REST

CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 300.0  # a connection that moves no byte either way for this long is ended
REFUSED = {"connection_refused": 502, "timeout": 504}


class Use:
    """The connection as the VM's use (`Activity`): from its start to its end, except while
    the client keeps it only for later (TCP_REST, until its next bytes). A connection that ends
    while kept is not use either: the VM's idle time runs from the kept one's last answer."""

    def __init__(self, activity: Activity, vm_id: str) -> None:
        self.activity, self.vm_id = activity, vm_id
        self.resting = False
        activity.begin(vm_id)

    def rest(self) -> None:
        if not self.resting:
            self.resting = True
            self.activity.end(self.vm_id)

    def wake(self) -> None:
        if self.resting:
            self.resting = False
            self.activity.begin(self.vm_id)


async def bridge(ws: WebSocket, agent: AgentClient, port: int, use: Use) -> None:
    try:
        await _bridge(ws, agent, port, use)
    finally:
        use.rest()  # ended: no use any more (nothing to do if it was kept when it ended)


async def _bridge(ws: WebSocket, agent: AgentClient, port: int, use: Use) -> None:
    await ws.accept()
    try:
        stream = await agent.tcp_connect(
            port, connect_timeout=CONNECT_TIMEOUT_S, idle_timeout=IDLE_TIMEOUT_S
        )
    except AgentError as e:
        status = REFUSED.get(e.code, 502)
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await ws.close(code=4000 + status, reason=f"port {port}: {e.message}"[:120])
        return
    async with stream:
        down = asyncio.ensure_future(_down(ws, stream))
        up = asyncio.ensure_future(_up(ws, stream, use))
        try:
            # The guest's side ended (or broke): nothing more to send. Or the client went
            # away (`_up` aborted the connection): nobody to send to.
            await asyncio.wait([down, up], return_when=asyncio.FIRST_COMPLETED)
            if down.done():
                down.result()
        finally:
            for task in (up, down):
                task.cancel()
            for task in (up, down):
                with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, AgentError):
                    await task
    with contextlib.suppress(WebSocketDisconnect, RuntimeError):
        await ws.close(code=1000)


async def _down(ws: WebSocket, stream: TcpStream) -> None:
    try:
        async for data in stream:
            for i in range(0, len(data), TCP_FRAME):
                await ws.send_bytes(data[i : i + TCP_FRAME])
    except AgentError as e:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):
            await ws.close(code=4502, reason=f"the connection broke: {e.message}"[:120])
        raise WebSocketDisconnect(4502) from None


async def _up(ws: WebSocket, stream: TcpStream, use: Use) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            await stream.close()
            return
        if message.get("bytes"):
            use.wake()
            await stream.write(message["bytes"])
        elif message.get("text") == TCP_EOF:
            await stream.close_write()
        elif message.get("text") == TCP_REST:
            use.rest()

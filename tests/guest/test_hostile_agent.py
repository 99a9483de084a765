"""The client against an agent that lies: the tenant is root in its guest and can take its agent
over, so the worker must hold whatever comes back to its limits, not trust the agent to.

Each test runs a fake agent that authenticates properly and then misbehaves in one way."""

from __future__ import annotations

import asyncio
import json
import socket
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from space.guest import protocol as p
from space.worker import agent_client, agent_connection
from space.worker.agent_client import (
    AgentClient,
    AgentConnectionLost,
    AgentError,
    AgentProtocolError,
    AgentTimeout,
)

Writer = asyncio.StreamWriter
# (writer, channel, request, frames the host sent on that channel since)
Inbox = asyncio.Queue[tuple[p.FrameType, bytes]]
Handler = Callable[[Writer, int, dict[str, Any], Inbox], Awaitable[None]]


async def send(w: Writer, ftype: p.FrameType, channel: int, payload: bytes = b"") -> None:
    w.write(p.HEADER.pack(p.MAGIC, ftype, 0, channel, len(payload)) + payload)
    await w.drain()


async def reply(w: Writer, channel: int, body: dict[str, Any]) -> None:
    await send(w, p.FrameType.REPLY, channel, json.dumps(body).encode())


@pytest.fixture
async def hostile() -> AsyncIterator[Callable[[Handler], Awaitable[AgentClient]]]:
    tasks: list[asyncio.Task[None]] = []
    clients: list[AgentClient] = []
    writers: list[Writer] = []

    async def start(handler: Handler) -> AgentClient:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=theirs)
        writers.append(writer)

        async def serve() -> None:
            decoder = p.FrameDecoder()
            inboxes: dict[int, asyncio.Queue[tuple[p.FrameType, bytes]]] = {}
            while data := await reader.read(1 << 16):
                for ftype, channel, payload in decoder.feed(data):
                    if ftype == p.FrameType.HELLO:
                        writer.write(p.welcome_frame(p.decode_json(payload)["nonce"], True))
                    elif ftype == p.FrameType.REQUEST:
                        inboxes[channel] = asyncio.Queue()
                        req = p.decode_json(payload)
                        coro = handler(writer, channel, req, inboxes[channel])
                        tasks.append(asyncio.ensure_future(coro))
                    elif channel in inboxes:
                        inboxes[channel].put_nowait((ftype, payload))

        tasks.append(asyncio.ensure_future(serve()))
        client = await AgentClient.connect(
            lambda: asyncio.open_connection(sock=ours), "token", timeout=5
        )
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for writer in writers:
        writer.transport.abort()  # the fake agent's end: no socket left for the GC to close


async def test_a_giant_frame_header_drops_the_connection_unread(hostile: Any) -> None:
    async def giant(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        w.write(p.HEADER.pack(p.MAGIC, p.FrameType.REPLY, 0, ch, 0xFFFFFFFF))
        for _ in range(64):  # and then 64 MiB of "payload", if anyone were to wait for it
            w.write(b"\0" * (1 << 20))
            await w.drain()

    tracemalloc.start()
    try:
        client = await hostile(giant)
        with pytest.raises(AgentConnectionLost, match=r"broke the protocol.*more than"):
            await client.ping()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not client.connected
    assert peak < 4 << 20, f"{peak} bytes allocated for a frame that was refused"


async def test_an_oversized_reply_is_refused(hostile: Any) -> None:
    async def fat(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        await reply(w, ch, {"pad": "x" * p.MAX_JSON})  # a valid frame, but no reply is so big

    client = await hostile(fat)
    with pytest.raises(AgentConnectionLost, match=r"REPLY of .* bytes"):
        await client.info()


async def test_a_reply_nested_too_deep_is_an_error_not_a_crash(hostile: Any) -> None:
    async def deep(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        await send(w, p.FrameType.REPLY, ch, b"[" * 200_000)

    client = await hostile(deep)
    with pytest.raises(AgentError) as e:
        await client.info()
    assert e.value.code == "protocol" and client.connected


async def test_a_flood_past_max_output_is_dropped_and_the_process_killed(hostile: Any) -> None:
    killed = asyncio.Event()

    async def flood(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        assert req["max_output"] == 1 << 20
        await send(w, p.FrameType.EVENT, ch, b'{"pid": 42}')
        for _ in range(256):  # 64 MiB on each stream, whatever the host asked for
            await send(w, p.FrameType.STDOUT, ch, b"o" * (256 << 10))
            await send(w, p.FrameType.STDERR, ch, b"e" * (256 << 10))
            while not inbox.empty():
                ftype, payload = inbox.get_nowait()
                if ftype == p.FrameType.CONTROL and json.loads(payload) == {"signal": 9}:
                    killed.set()
        await reply(w, ch, {"exit_code": 0, "signal": None, "timed_out": False,
                            "duration_ms": 1.0})  # fmt: skip

    client = await hostile(flood)
    tracemalloc.start()
    try:
        r = await client.run(["yes"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.truncated and len(r.stdout) == len(r.stderr) == 1 << 20
    assert killed.is_set()
    assert peak < 12 << 20, f"{peak} bytes held for 128 MiB of output capped at 2 x 1 MiB"


async def test_a_silent_agent_meets_every_deadline(
    hostile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def silent(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        if req["op"] == "exec":
            await send(w, p.FrameType.EVENT, ch, b'{"pid": 42}')
        await asyncio.sleep(3600)

    monkeypatch.setattr(agent_client, "RUN_GRACE_S", 0.3)
    client = await hostile(silent)
    with pytest.raises(AgentTimeout, match="stat"):
        await client.call("stat", path="/", deadline=0.3)
    with pytest.raises(AgentTimeout, match="running sleep 1"):
        await client.run(["sleep", "1"], timeout=0.2)
    with pytest.raises(AgentTimeout):
        await client.sync(deadline=0.3)
    assert client._channels == {}  # abandoned channels are forgotten, not kept for ever
    assert client.connected


async def test_an_agent_that_does_not_read_fails_our_send_not_our_memory(
    hostile: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def deaf(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        w.transport.pause_reading()  # from now on it takes nothing more from us
        await send(w, p.FrameType.EVENT, ch, b'{"ready": true}')

    monkeypatch.setattr(agent_connection, "SEND_DEADLINE_S", 0.5)
    client = await hostile(deaf)

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"z" * (1 << 20)

    with pytest.raises(AgentTimeout, match="sending"):
        await asyncio.wait_for(client.write_file("/f", endless()), 30)
    # Queued in the worker: at most one frame past the transport's high-water mark.
    assert client._writer.transport.get_write_buffer_size() <= (64 << 10) + p.CHUNK_SIZE + 64


async def test_answers_of_the_wrong_shape_are_refused(hostile: Any) -> None:
    answers: dict[str, dict[str, Any]] = {
        "grow_root_fs": {"disk_bytes": "lots", "block_size": 4096, "fs_bytes_before": 1,
                         "fs_bytes": 2},
        "mount_volumes": {"mounted": [{"serial": "v"}]},
        "unmount": {"unmounted": [1], "failed": {}},
        "install_ca": {"ca": "/etc/space/ca.pem"},
        "list_dir": {"entries": [{}] * 11},
    }  # fmt: skip

    async def wrong(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        await reply(w, ch, answers[req["op"]])

    client = await hostile(wrong)
    calls = [
        client.grow_root_fs(),
        client.mount_volumes([agent_client.GuestVolume("v", "/mnt")]),
        client.unmount(["/mnt"]),
        client.install_ca(b"-----BEGIN CERTIFICATE-----"),
        client.scan_dir("/", limit=10),
    ]
    for call in calls:
        with pytest.raises(AgentProtocolError):
            await call


async def test_a_guest_past_its_tcp_window_is_cut_off(hostile: Any) -> None:
    closed = asyncio.Event()

    async def overrun(w: Writer, ch: int, req: dict[str, Any], inbox: Any) -> None:
        await send(w, p.FrameType.EVENT, ch, b'{"connected": true}')
        for _ in range(16):  # 4 MiB, never waiting for an acknowledgement
            await send(w, p.FrameType.DATA, ch, b"d" * (256 << 10))
        while True:
            ftype, payload = await inbox.get()
            if ftype == p.FrameType.CONTROL and json.loads(payload).get("close"):
                closed.set()
                return

    client = await hostile(overrun)
    stream = await client.tcp_connect(80)
    await asyncio.sleep(0.5)
    assert stream._held <= p.TCP_WINDOW and client._buffered <= p.TCP_WINDOW
    with pytest.raises(AgentProtocolError, match="more than"):
        while await stream.read():
            pass
    await asyncio.wait_for(closed.wait(), 5)
    assert client.connected  # one bad channel, the connection goes on

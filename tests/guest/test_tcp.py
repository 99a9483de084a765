"""tcp_connect through a real agent process on the host, to loopback servers of the test's own:
bytes both ways, half-close, resets, refusals, and backpressure that holds memory down on both
sides."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from space.guest import protocol as p
from space.worker.agent_client import AgentClient, AgentError, TcpStream

from .conftest import AgentProcess

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[int]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield start
    for server in servers:
        server.close()


async def read_all(stream: TcpStream) -> bytes:
    return b"".join([chunk async for chunk in stream])


async def test_bytes_both_ways_with_half_close(
    agent: AgentClient, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    async def digest_then_answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until our half-close
        w.write(hashlib.sha256(data).hexdigest().encode() + b"\n" + data[::-1])
        await w.drain()
        w.close()

    port = await serve(digest_then_answer)
    data = os.urandom(5 << 20)
    async with await agent.tcp_connect(port) as stream:
        await stream.write(data)
        await stream.close_write()
        answer = await read_all(stream)
        closed = await stream.wait_closed()
    digest, _, back = answer.partition(b"\n")
    assert digest.decode() == hashlib.sha256(data).hexdigest() and back == data[::-1]
    assert (closed.sent, closed.received, closed.reset) == (len(data), len(answer), False)


async def test_echo_while_writing_does_not_deadlock(
    agent: AgentClient, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    port = await serve(echo)
    data = os.urandom(8 << 20)
    stream = await agent.tcp_connect(port)

    async def send() -> None:
        await stream.write(data)
        await stream.close_write()

    _, back = await asyncio.gather(send(), read_all(stream))
    assert back == data
    await stream.close()


async def test_a_guest_that_does_not_read_stops_our_writes_not_our_memory(
    agent: AgentClient, agent_process: AgentProcess, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    hold = asyncio.Event()

    async def never_reads(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await hold.wait()
        w.close()

    port = await serve(never_reads)
    rss_before = agent_process.rss_kib()
    stream = await agent.tcp_connect(port, idle_timeout=2)
    sent = 0
    with pytest.raises(AgentError) as e:
        for _ in range(256):  # 64 MiB, if nothing pushed back
            await stream.write(b"x" * (256 << 10))
            sent += 256 << 10
    assert e.value.code == "timeout"
    # What got out is the window plus the kernel's socket buffers, not all of it.
    assert sent < 32 << 20
    assert agent_process.rss_kib() - rss_before < 16 << 10
    await stream.close()
    hold.set()


async def test_a_reader_that_does_not_read_stops_the_agent_reading(
    agent: AgentClient, agent_process: AgentProcess, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    async def floods(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            for _ in range(1024):  # 256 MiB unless someone stops us
                w.write(b"y" * (256 << 10))
                await w.drain()
        except ConnectionError:
            pass
        w.close()

    port = await serve(floods)
    rss_before = agent_process.rss_kib()
    stream = await agent.tcp_connect(port)
    await asyncio.sleep(1.0)  # we read nothing meanwhile
    assert stream._held <= p.TCP_WINDOW
    assert agent._buffered <= p.TCP_WINDOW
    assert agent_process.rss_kib() - rss_before < 16 << 10
    got = 0
    while got < 20 << 20:
        got += len(await stream.read())
    closed = await stream.close()
    assert closed is not None and closed.closed


async def test_close_resets_the_guest_side(
    agent: AgentClient, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    seen: asyncio.Future[BaseException | bytes] = asyncio.get_running_loop().create_future()

    async def waits(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            seen.set_result(await r.read())
        except ConnectionError as e:
            seen.set_result(e)

    port = await serve(waits)
    stream = await agent.tcp_connect(port)
    await stream.write(b"partial")
    await asyncio.sleep(0.2)
    await stream.close()
    assert isinstance(await asyncio.wait_for(seen, 5), ConnectionResetError)


async def test_a_guest_reset_ends_the_stream_and_says_so(
    agent: AgentClient, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    async def resets(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hello")
        await w.drain()
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        w.transport.abort()

    port = await serve(resets)
    stream = await agent.tcp_connect(port)
    assert await read_all(stream) == b"hello"
    await stream.close_write()
    closed = await stream.wait_closed()
    assert closed.received == 5 and closed.reset


async def test_refused_and_foreign_addresses(agent: AgentClient) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(AgentError) as e:
        await agent.tcp_connect(free)
    assert e.value.code == "connection_refused"
    # Not an address of this machine (TEST-NET-1): refused before any packet leaves.
    with pytest.raises(AgentError, match="not an address of the guest") as e:
        await agent.tcp_connect(80, host="192.0.2.1")
    assert e.value.code == "invalid"
    for bad in ({"port": 0}, {"port": 70000}, {"port": 80, "host": "localhost"}):
        with pytest.raises(AgentError) as e:
            await agent.call("tcp_connect", **bad)
        assert e.value.code == "invalid"


async def test_many_streams_at_once_on_one_connection(
    agent: AgentClient, serve: Callable[[Handler], Awaitable[int]]
) -> None:
    async def upper(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write((await r.read()).upper())
        await w.drain()
        w.close()

    port = await serve(upper)

    async def one(i: int) -> bytes:
        async with await agent.tcp_connect(port) as stream:
            await stream.write(f"stream {i}".encode())
            await stream.close_write()
            return await read_all(stream)

    got = await asyncio.gather(*(one(i) for i in range(20)))
    assert got == [f"STREAM {i}".encode() for i in range(20)]

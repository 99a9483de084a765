"""The API's calls wait for a worker that is restarting (it refuses connections for a moment),
stream or not, and fail once the wait is over; the controller's calls fail at once."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator

import pytest

from space.worker.api.client import Worker, WorkerClient, WorkerError
from space.worker.api.models import ExecRequest

from ..stack import free_port

LATE_S = 1.0  # the worker comes up this long after the call


async def _serve(port: int, calls: list[str]) -> asyncio.Server:
    """A stand-in worker: each request is noted and answered 204, or with one exit event for
    an exec."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        method, path, _ = head.split(" ", 2)
        length = next((int(h.split(":")[1]) for h in head.split("\r\n")
                       if h.lower().startswith("content-length:")), 0)  # fmt: skip
        await reader.readexactly(length)
        calls.append(f"{method} {path}")
        body = b'{"type": "exit", "exit_code": 0}\n' if path.endswith("/exec") else b""
        status = "200 OK" if body else "204 No Content"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)  # fmt: skip
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port)


@pytest.fixture
async def late() -> AsyncIterator[tuple[Worker, list[str]]]:
    """A worker whose port opens LATE_S from now."""
    port, calls = free_port(), []
    started: list[asyncio.Server] = []

    async def open_later() -> None:
        await asyncio.sleep(LATE_S)
        started.append(await _serve(port, calls))

    opening = asyncio.ensure_future(open_later())
    yield Worker("w-late", f"http://127.0.0.1:{port}"), calls
    opening.cancel()
    for server in started:
        server.close()


@pytest.mark.parametrize("first", ["call", "stream"])
async def test_a_call_waits_for_a_worker_coming_back(
    late: tuple[Worker, list[str]], first: str
) -> None:
    worker, calls = late
    client = WorkerClient("secret", reconnect_s=10)

    async def call() -> None:
        await client.delete_vm(worker, "vm-1")

    async def stream() -> None:
        async with client.exec_stream(worker, "vm-1", ExecRequest(cmd="true")) as resp:
            assert b"exit" in await resp.aread()

    try:
        started = time.monotonic()
        await (call() if first == "call" else stream())
        assert time.monotonic() - started >= LATE_S * 0.9, "it did not wait"
        await (stream() if first == "call" else call())
    finally:
        await client.close()
    assert sorted(calls) == ["DELETE /vms/vm-1", "POST /vms/vm-1/exec"]


async def test_without_a_wait_or_past_it_the_refusal_is_an_error(
    late: tuple[Worker, list[str]],
) -> None:
    worker, calls = late
    for client, most_s in ((WorkerClient("secret"), 0.5), (WorkerClient("x", reconnect_s=0.3), 1)):
        started = time.monotonic()
        try:
            with pytest.raises(WorkerError, match="unreachable"):
                await client.delete_vm(worker, "vm-1")
        finally:
            await client.close()
        assert time.monotonic() - started < most_s
    assert calls == []


async def test_a_request_that_reached_the_worker_is_never_sent_again() -> None:
    """A worker that read the request and closed without an answer may have acted on it: the
    call fails, once."""
    calls: list[str] = []

    async def read_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        calls.append((await reader.readuntil(b"\r\n\r\n")).decode().split(" ", 2)[1])
        writer.close()

    server = await asyncio.start_server(read_and_close, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = WorkerClient("secret", reconnect_s=10)
    try:
        with pytest.raises(WorkerError):
            await client.delete_vm(Worker("w-once", f"http://127.0.0.1:{port}"), "vm-1")
    finally:
        await client.close()
        server.close()
    assert calls == ["/vms/vm-1"]


async def test_a_connection_that_fails_otherwise_than_refused_is_not_waited_for() -> None:
    """A worker that accepts and hangs up before TLS is done (as one showing no certificate, or
    not speaking TLS, does) will not mend in seconds: the call fails at once."""

    async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = WorkerClient("secret", tls=ssl.create_default_context(), reconnect_s=10)
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="unreachable"):
            await client.delete_vm(Worker("w-hangs-up", f"https://127.0.0.1:{port}"), "vm-1")
    finally:
        await client.close()
        server.close()
    assert time.monotonic() - started < 5

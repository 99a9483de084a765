"""A real VM whose agent the tenant has taken over (root in the guest can): the worker's client,
over the real virtio-serial port, holds it to its limits. The VM boots an initramfs whose agent
is ours with three operations made hostile: `exec` floods output whatever cap it was given,
`info` answers with a REPLY larger than any reply may be, `ping` with a frame header claiming
4 GiB and then 64 MiB of bytes.
"""

from __future__ import annotations

import asyncio
import shutil
import tracemalloc
from collections.abc import AsyncIterator

import pytest

from space.worker.agent_client import AgentConnectionLost
from space.worker.images.kernel import ensure_kernel, guest_agent_dir
from space.worker.local import LocalRuntime
from space.worker.machine import BootImages, Machine

pytestmark = pytest.mark.vm

HOSTILE = """

# --- made hostile for tests/vm/test_hostile_agent.py --------------------------------------


async def _flood(conn: Connection, channel: int, req: Json) -> Json:
    await conn.send_json(p.FrameType.EVENT, channel, {"pid": 4242})
    for _ in range(256):  # 64 MiB, whatever max_output said
        await conn.send(p.FrameType.STDOUT, channel, b"f" * (256 << 10))
    return {"exit_code": 0, "signal": None, "timed_out": False, "duration_ms": 1.0}


async def _fat_reply(conn: Connection, channel: int, req: Json) -> Json:
    return {"pad": "x" * (p.MAX_JSON + 1)}  # sent as is below, past the agent's own check


async def _giant_frame(conn: Connection, channel: int, req: Json) -> Json:
    await conn._write(p.HEADER.pack(p.MAGIC, p.FrameType.REPLY, 0, channel, 0xFFFFFFFF))
    for _ in range(64):
        await conn._write(b"\\0" * (1 << 20))
    return {}


async def _run_hostile(self: Connection, channel: int, payload: bytes) -> None:
    req = p.decode_json(payload)
    handler = {"exec": _flood, "info": _fat_reply, "ping": _giant_frame}.get(req.get("op"))
    if handler is None:
        return await _honest_run_op(self, channel, payload)
    self.inboxes.pop(channel, None)
    result = await handler(self, channel, req)
    await self._write(p.encode_json(p.FrameType.REPLY, channel, result))


_honest_run_op = Connection._run_op
Connection._run_op = _run_hostile  # type: ignore[method-assign]
"""


@pytest.fixture(scope="module")
async def hostile(
    runtime: LocalRuntime, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Machine]:
    agent_dir = tmp_path_factory.mktemp("hostile") / "guest"
    shutil.copytree(guest_agent_dir(), agent_dir, ignore=shutil.ignore_patterns("__pycache__"))
    with (agent_dir / "agent.py").open("a") as f:
        f.write(HOSTILE)
    kernel = await asyncio.to_thread(ensure_kernel, agent_dir=agent_dir)
    images = BootImages(kernel.vmlinux, kernel.initrd, runtime.images.rootfs)
    async with await Machine.boot(runtime.driver, runtime.pool, images) as m:
        yield m


async def test_a_flood_past_the_cap_is_dropped_by_the_worker(hostile: Machine) -> None:
    tracemalloc.start()
    try:
        r = await hostile.agent.run(["true"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.truncated and len(r.stdout) == 1 << 20
    assert peak < 12 << 20, f"{peak} bytes held for 64 MiB of output capped at 1 MiB"
    assert hostile.agent.connected


async def test_an_oversized_reply_drops_the_connection(hostile: Machine) -> None:
    with pytest.raises(AgentConnectionLost, match="REPLY of"):
        await hostile.agent.info()
    await hostile.reconnect()
    assert (await hostile.agent.stat("/"))["type"] == "directory"


async def test_a_giant_frame_header_is_refused_unread(hostile: Machine) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(AgentConnectionLost, match="more than"):
            await hostile.agent.ping()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated for a frame that was refused"
    assert not hostile.agent.connected

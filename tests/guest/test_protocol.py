"""Framing: frames survive any split of the byte stream, and garbage is skipped, not fatal."""

from __future__ import annotations

import asyncio
import os

from hypothesis import given
from hypothesis import strategies as st

from space.guest import protocol as p
from space.worker.agent_client import AgentClient

frames = st.lists(
    st.tuples(
        st.sampled_from(list(p.FrameType)),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=2000),
    ),
    max_size=20,
)


@given(frames, st.lists(st.integers(1, 500), min_size=1, max_size=50))
def test_frames_round_trip_through_any_split(
    items: list[tuple[p.FrameType, int, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(p.encode(t, c, data) for t, c, data in items)
    decoder = p.FrameDecoder()
    out = []
    pos = 0
    i = 0
    while pos < len(stream):
        n = cuts[i % len(cuts)]
        out += list(decoder.feed(stream[pos : pos + n]))
        pos += n
        i += 1
    assert out == items
    assert decoder.skipped == 0


def test_garbage_before_a_frame_is_skipped() -> None:
    decoder = p.FrameDecoder()
    garbage = os.urandom(3000).replace(b"SP", b"xx") + b"S"
    frame = p.encode_json(p.FrameType.WELCOME, 0, {"nonce": "n1"})
    got = list(decoder.feed(garbage + frame))
    assert got == [(p.FrameType.WELCOME, 0, frame[p.HEADER_SIZE :])]
    assert decoder.skipped == len(garbage)


async def test_client_finds_its_welcome_behind_a_cut_frame() -> None:
    """What the host sees when a snapshot cut the agent off mid-frame: a frame header whose
    length swallows what follows. The client must still find its WELCOME and decode after it."""
    cut = p.encode(p.FrameType.STDOUT, 7, b"x" * 5000)[:40]
    server_side: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    server = await asyncio.start_server(lambda r, w: server_side.put_nowait((r, w)), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def fake_agent() -> None:
        reader, writer = await server_side.get()
        decoder = p.FrameDecoder()
        while True:
            for ftype, channel, payload in decoder.feed(await reader.read(4096)):
                if ftype == p.FrameType.HELLO:
                    nonce = p.decode_json(payload)["nonce"]
                    writer.write(cut + p.welcome_frame(nonce, True))
                elif ftype == p.FrameType.REQUEST:
                    writer.write(p.encode_json(p.FrameType.REPLY, channel, {"pong": True}))
                    await writer.drain()
                    return

    agent = asyncio.ensure_future(fake_agent())
    client = await AgentClient.connect(
        lambda: asyncio.open_connection("127.0.0.1", port), "token", timeout=5
    )
    assert await client.call("ping") == {"pong": True}
    await agent
    await client.close()
    server.close()


def test_oversized_length_is_not_trusted() -> None:
    decoder = p.FrameDecoder()
    bogus = p.HEADER.pack(p.MAGIC, p.FrameType.DATA, 0, 1, p.MAX_PAYLOAD + 1)
    whole = p.encode(p.FrameType.END, 3)
    assert list(decoder.feed(bogus + whole)) == [(p.FrameType.END, 3, b"")]

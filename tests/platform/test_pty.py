"""Terminals through the SDK (`sandbox.pty`), in real VMs: a real PTY of the size asked and
resized, keystrokes in (Ctrl-C interrupts what runs in it), the screen out to whoever connects,
the program's exit code at the end; another tenant's key reaches none of it."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

import space

from ..stack import Platform

pytestmark = pytest.mark.vm


def _until(stream: space.ExecStream, *wanted: bytes) -> bytes:
    """The screen's bytes up to the first point where all of `wanted` were shown."""
    seen = b""
    for _, data in stream:
        seen += data
        if all(w in seen for w in wanted):
            return seen
    raise AssertionError(f"the terminal ended before showing {wanted}: {seen!r}")


def _within(seconds: float, done: Callable[[], bool], why: str) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, why
        time.sleep(0.2)


def test_a_terminal_takes_keys_sizes_and_ctrl_c(platform: Platform) -> None:
    with (
        space.Space(platform.api_url, platform.key_a) as client,
        space.Sandbox.create(client=client) as sb,
    ):
        term = sb.pty.create(rows=30, cols=100, tag="term")
        assert term.info.pty and term.info.running and term.info.tag == "term"
        with term.output() as screen:
            term.write("stty size; tty; echo TERM=$TERM\n")
            _until(screen, b"30 100", b"/dev/pts/", b"TERM=xterm-256color")

        term.resize(40, 120)
        # Ctrl-C goes to the PTY's foreground job: the sleep stops, the shell lives on.
        again = sb.pty.connect("term")
        assert again.pid == term.pid
        sleeping = lambda: sb.exec("pgrep -x sleep").ok  # noqa: E731
        with again.output() as screen:
            again.write("sleep 300\n")
            # Only once the sleep is the foreground job: a Ctrl-C before it would reach the
            # shell, and the sleep would run its whole time.
            _within(60, sleeping, "the sleep never started")
            again.write("\x03")
            _within(60, lambda: not sleeping(), "Ctrl-C did not stop the sleep")
            again.write("stty size; echo after-$((40+2))\n")
            _until(screen, b"40 120", b"after-42")
        assert term.refresh().running

        term.write("exit 3\n")
        result = term.wait()
        assert result.exit_code == 3
        # One stream on a terminal: what it showed went to stdout (the replay holds all of it).
        assert b"TERM=xterm-256color" in result.stdout and result.stderr == b""
        assert not term.refresh().running


async def test_an_async_terminal_and_another_tenant(platform: Platform) -> None:
    async with (
        space.AsyncSpace(platform.api_url, platform.key_a) as client,
        space.AsyncSpace(platform.api_url, platform.key_b) as other,
    ):
        sb = await space.AsyncSandbox.create(client=client)
        try:
            term = await sb.pty.create(["cat"], env={"TERM": "dumb"})
            with pytest.raises(space.NotFoundError):
                await space.AsyncSandbox(other, sb.info).pty.connect(term.pid)
            await term.write("hi\n")
            seen = b""
            async with term.output() as screen:
                async for _, data in screen:
                    seen += data
                    # The PTY echoes what was typed, then cat writes it back: CR LF each.
                    if seen.count(b"hi\r\n") == 2:
                        break
            await term.kill()
            result = await term.wait()
            assert result.signal is not None and not (await term.refresh()).running
        finally:
            await sb.delete()

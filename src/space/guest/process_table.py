"""The agent's processes, by pid and by tag, and the operations on them: exec, attach,
processes, control (see `protocol`).

Every process the agent started is in the table while it runs. A background one also outlives
the channel that started it: its latest output is kept (`OUTPUT_RING`) for the next channel that
attaches, and once it ended it stays listed, with its result, among the last `EXITED_KEPT`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import re
from typing import TYPE_CHECKING, Any

from . import protocol as p
from .common import Json, OpError
from .processes import Listener, Process, Reaper
from .spawn import spawn

if TYPE_CHECKING:
    from .agent import Connection

ACK_GRAIN = 64 << 10  # input acknowledged in pieces of at least this much
EXITED_KEPT = 32
# Never all digits (that reads as a pid), never dots alone (a path segment of its own).
TAG = re.compile(r"^(?!\d+$)[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$")


class ProcessTable:
    def __init__(self) -> None:
        self.reaper: Reaper  # set once the agent's loop runs
        self._running: dict[int, Process] = {}
        self._exited: collections.OrderedDict[int, Process] = collections.OrderedDict()

    def start(self, req: Json) -> Process:
        timeout = req.get("timeout")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise OpError(p.ErrorCode.INVALID, "'timeout' must be a positive number of seconds")
        max_output = req.get("max_output")
        if max_output is not None and (
            not isinstance(max_output, int) or isinstance(max_output, bool) or max_output < 0
        ):
            raise OpError(p.ErrorCode.INVALID, "'max_output' must be a number of bytes")
        tag = req.get("tag")
        if tag is not None:
            if not isinstance(tag, str) or not TAG.match(tag):
                raise OpError(
                    p.ErrorCode.INVALID,
                    "'tag' must be 1-64 of letters, digits and _.:-, start with a letter, digit "
                    "or _, and not be a number",
                )
            if any(proc.tag == tag for proc in self._running.values()):
                raise OpError(p.ErrorCode.EXISTS, f"a running process is tagged {tag!r}")
        background = bool(req.get("background")) or tag is not None
        proc = Process(spawn(req), req, background=background, tag=tag)
        proc.max_output = max_output
        self._running[proc.pid] = proc
        self._exited.pop(proc.pid, None)
        if tag is not None:
            for pid in [pid for pid, old in self._exited.items() if old.tag == tag]:
                del self._exited[pid]
        proc.start(self.reaper.watch(proc.pid), timeout, self._retire)
        return proc

    def _retire(self, proc: Process) -> None:
        if self._running.get(proc.pid) is proc:
            del self._running[proc.pid]
        if proc.background:
            self._exited[proc.pid] = proc
            while len(self._exited) > EXITED_KEPT:
                self._exited.popitem(last=False)

    def find(self, req: Json) -> Process:
        """The process a request names by "pid" or by "tag" (running ones first)."""
        pid, tag = req.get("pid"), req.get("tag")
        if isinstance(pid, int) and not isinstance(pid, bool):
            found = self._running.get(pid) or self._exited.get(pid)
            what = f"pid {pid}"
        elif isinstance(tag, str):
            candidates = [*self._running.values(), *reversed(self._exited.values())]
            found = next((proc for proc in candidates if proc.tag == tag), None)
            what = f"tag {tag!r}"
        else:
            raise OpError(p.ErrorCode.INVALID, "name the process by 'pid' (a number) or 'tag'")
        if found is None:
            raise OpError(p.ErrorCode.NOT_FOUND, f"no process started by the agent has {what}")
        return found

    def listing(self) -> list[Json]:
        procs = [*self._running.values(), *self._exited.values()]
        return [proc.info() for proc in sorted(procs, key=lambda proc: proc.started_at)]


async def follow(conn: Connection, channel: int, proc: Process, *, replay: bool) -> Json:
    """Streams `proc` on this channel (its ring first if `replay`) and passes the channel's
    input to it, until it ends (→ its result), the host sends CONTROL {detach} (→ {detached})
    or goes away. Called right after `start` with nothing awaited between, so no output of a
    new process comes before its first EVENT."""
    inbox = conn.inboxes[channel]
    me = Listener(conn, channel)
    async with proc.output_lock:
        started: Json = {
            "pid": proc.pid, "tag": proc.tag, "background": proc.background,
            "running": not proc.done.is_set(),
        }  # fmt: skip
        if replay:
            started["dropped"] = proc.ring.dropped
        if proc.stdin is not None:
            started["window"] = p.DATA_WINDOW
        await conn.send_json(p.FrameType.EVENT, channel, started)
        if replay:
            for ftype, data in proc.ring:
                await conn.send(ftype, channel, data)
        proc.listeners.append(me)
    detached = asyncio.Event()
    # Input taken and not yet acknowledged: (its end, its size), small frames merged so that
    # tiny ones cost no more than large.
    owed: collections.deque[tuple[int, int]] = collections.deque()
    owing = asyncio.Event()

    async def feed() -> None:
        while True:
            ftype, payload = await inbox.get()
            ctl = proc.on_frame(ftype, payload)
            if ftype == p.FrameType.STDIN and proc.stdin is not None:
                size = len(payload)
                if owed and owed[-1][1] < ACK_GRAIN:
                    size += owed.pop()[1]
                owed.append((proc.stdin.taken, size))
                owing.set()
            if ctl is not None and ctl.get("detach") is True:
                detached.set()

    async def acknowledge() -> None:
        """Input once the process has it (in its pipe): the host's window opens again."""
        while True:
            await owing.wait()
            stdin = proc.stdin
            if stdin is not None:
                await stdin.reached(owed[0][0])
            done = 0
            while owed and (stdin is None or stdin.closed or owed[0][0] <= stdin.written):
                done += owed.popleft()[1]
            if not owed:
                owing.clear()
            if done:
                await conn.send_json(p.FrameType.EVENT, channel, {"ack": done})

    waits = [asyncio.ensure_future(e.wait()) for e in (proc.done, detached, conn.gone)]
    helpers = [asyncio.ensure_future(feed()), asyncio.ensure_future(acknowledge())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (*waits, *helpers):
            task.cancel()
        async with proc.output_lock:
            if me in proc.listeners:
                proc.listeners.remove(me)
    if proc.done.is_set():
        return proc.result
    return {"detached": True, "pid": proc.pid}


class ProcessOps:
    """The agent's operations on its processes."""

    def __init__(self, table: ProcessTable) -> None:
        self.table = table

    async def exec(self, conn: Connection, channel: int, req: Json) -> Json:
        proc = self.table.start(req)
        if req.get("detach"):
            if not proc.background:
                raise OpError(p.ErrorCode.INVALID, "only a background process can be detached")
            return proc.info()
        return await follow(conn, channel, proc, replay=False)

    async def attach(self, conn: Connection, channel: int, req: Json) -> Json:
        proc = self.table.find(req)
        return await follow(conn, channel, proc, replay=req.get("replay", True) is True)

    async def processes(self, conn: Connection, channel: int, req: Json) -> Json:
        return {"processes": self.table.listing()}

    async def control(self, conn: Connection, channel: int, req: Json) -> Json:
        """Input, end of input, a signal or a new terminal size for a process, without
        following it."""
        proc = self.table.find(req)
        if proc.done.is_set():  # as the listing says: ended once its result is there
            raise OpError(p.ErrorCode.NOT_FOUND, f"process {proc.pid} has ended")
        if "stdin" in req:
            proc.write(_b64(req, "stdin"))
        if req.get("eof") is True:
            proc.close_stdin()
        if "resize" in req:
            size = req["resize"]
            if not (isinstance(size, list) and len(size) == 2 and all(_small(v) for v in size)):
                raise OpError(p.ErrorCode.INVALID, "'resize' must be [rows, cols], each 1-1000")
            proc.resize(size[0], size[1])
        if "signal" in req:
            signum = req["signal"]
            if not isinstance(signum, int) or isinstance(signum, bool) or not 0 < signum < 65:
                raise OpError(p.ErrorCode.INVALID, "'signal' must be a signal number (1-64)")
            proc.signal(signum)
        return {}


def _b64(req: Json, key: str) -> bytes:
    try:
        return base64.b64decode(str(req[key]), validate=True)
    except ValueError:
        raise OpError(p.ErrorCode.INVALID, f"{key!r} must be base64") from None


def _small(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 1000

"""Contexts: one Jupyter kernel each, its state kept between cells, one cell at a time.

A cell's output comes as the JSON objects E2B's SDK reads, in the order the kernel sent them:
`number_of_executions`, `stdout`/`stderr` text, `result` (a display or the cell's value, by
MIME type: text, html, png, …, and `data` and `chart` made by `formats`), `error` (name, value,
traceback), then `end_of_execution`.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from jupyter_client.manager import AsyncKernelManager
from tornado.web import HTTPError

from space.interpreter import formats

LANGUAGES = {"python": "python3"}  # what a context may speak -> its kernel's name
START_TIMEOUT_S = 120.0  # a kernel's start, under emulation too
DIED = "the kernel stopped (out of memory?); restart the context"
# What a cell's result carries under E2B's names; other MIME types go to `extra`.
MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown",
        "image/svg+xml": "svg", "image/png": "png", "image/jpeg": "jpeg",
        "application/pdf": "pdf", "text/latex": "latex", "application/json": "json",
        "application/javascript": "javascript", formats.DATA_MIME: "data",
        formats.CHART_MIME: "chart"}  # fmt: skip
# Run in every kernel as it starts: the displays E2B's SDK reads as `data` and `chart`.
DISPLAYS = "import space.interpreter.formats as __f\n__f.register()\ndel __f"


class ContextError(HTTPError):
    """What the caller asked cannot be done: the HTTP status and why, for the answer."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(status, why.replace("%", "%%"))  # tornado %-formats its log line
        self.why = why


class Context:
    """One kernel: its manager and client, and the lock that makes its cells take turns."""

    def __init__(self, language: str, cwd: str, manager: AsyncKernelManager) -> None:
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.manager = manager
        self.client = manager.client()
        self.turn = asyncio.Lock()

    @classmethod
    async def start(cls, language: str, cwd: str, preload: str = "") -> Context:
        kernel = LANGUAGES.get(language)
        if kernel is None:
            raise ContextError(400, f"language {language!r} is not in this template; "
                                    f"it has {', '.join(LANGUAGES)}")  # fmt: skip
        manager = AsyncKernelManager(kernel_name=kernel)
        await manager.start_kernel(cwd=cwd)
        context = cls(language, cwd, manager)
        await context._connect(preload)
        return context

    async def _connect(self, preload: str) -> None:
        self.client.start_channels()
        await self.client.wait_for_ready(timeout=START_TIMEOUT_S)
        await self._quietly(DISPLAYS)
        if preload:
            await self._quietly(preload)

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def execute(self, code: str, env: Mapping[str, str]) -> AsyncGenerator[dict[str, Any]]:
        """The cell's output, as it comes; `env` holds only while it runs."""
        async with self.turn:
            restore = await self._set_env(env) if env else ""
            try:
                # Not stop_on_error: a cell cut short by its caller's leaving must not abort
                # the next one, sent before the kernel was done with it.
                msg_id = self.client.execute(
                    code, store_history=True, allow_stdin=False, stop_on_error=False
                )
                async for output in self._outputs(msg_id):
                    yield output
            finally:
                if restore:
                    await self._quietly(restore)
        yield {"type": "end_of_execution"}

    async def _outputs(self, msg_id: str) -> AsyncIterator[dict[str, Any]]:
        while True:
            try:
                msg = await self.client.get_iopub_msg(timeout=1.0)
            except queue.Empty:
                if not await self.manager.is_alive():
                    yield {"type": "error", "name": "KernelDied", "traceback": "", "value": DIED}
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return
            if kind == "execute_input":
                yield {"type": "number_of_executions",
                       "execution_count": content.get("execution_count") or 0}  # fmt: skip
            elif kind == "stream":
                yield {"type": "stderr" if content.get("name") == "stderr" else "stdout",
                       "text": content.get("text", ""), "timestamp": time.time_ns()}  # fmt: skip
            elif kind in ("execute_result", "display_data"):
                yield result(content.get("data", {}), is_main=kind == "execute_result")
            elif kind == "error":
                yield {"type": "error", "name": content.get("ename", ""),
                       "value": content.get("evalue", ""),
                       "traceback": "\n".join(content.get("traceback", []))}  # fmt: skip

    async def _set_env(self, env: Mapping[str, str]) -> str:
        """Set `env` in the kernel; the code that puts back what it replaced."""
        names = json.dumps(sorted(env))
        await self._quietly(
            "import os as __space_os, json as __space_json\n"
            f"__space_env_before = {{k: __space_os.environ.get(k) for k in {names}}}\n"
            f"__space_os.environ.update(__space_json.loads({json.dumps(json.dumps(dict(env)))}))"
        )
        return (
            "for __k, __v in __space_env_before.items():\n"
            "    if __v is None:\n"
            "        __space_os.environ.pop(__k, None)\n"
            "    else:\n"
            "        __space_os.environ[__k] = __v\n"
            "del __space_env_before"
        )

    async def _quietly(self, code: str) -> None:
        """Run code of ours: not in the history, no output, no execution count."""
        msg_id = self.client.execute(code, silent=True, store_history=False, stop_on_error=False)
        async for _ in self._outputs(msg_id):
            pass

    async def interrupt(self) -> None:
        await self.manager.interrupt_kernel()

    async def restart(self, preload: str = "") -> None:
        async with self.turn:
            self.client.stop_channels()
            await self.manager.restart_kernel(now=True)
            self.client = self.manager.client()
            await self._connect(preload)

    async def shutdown(self) -> None:
        self.client.stop_channels()
        await self.manager.shutdown_kernel(now=True)


def result(data: Mapping[str, Any], *, is_main: bool) -> dict[str, Any]:
    """A display's data under E2B's names (`png`: base64, as the kernel sends it)."""
    out: dict[str, Any] = {"type": "result", "is_main_result": is_main}
    extra = {}
    for mime, value in data.items():
        if mime in MIME:
            out[MIME[mime]] = value
        else:
            extra[mime] = value
    if extra:
        out["extra"] = extra
    return out

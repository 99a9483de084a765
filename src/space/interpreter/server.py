"""The code interpreter's HTTP service (tornado): `python3 -m space.interpreter.server`.

  GET    /health                  200 once the default Python context answers
  POST   /execute                 {"code", "context_id"?, "language"?, "env_vars"?}: the cell's
                                  output as JSON lines, streamed; a client that goes away
                                  interrupts its cell
  POST   /contexts                {"language"?, "cwd"?} -> {"id", "language", "cwd"}
  GET    /contexts                every context
  DELETE /contexts/{id}           its kernel shut down
  POST   /contexts/{id}/restart   its kernel restarted (its state gone)

Bad input gets a 4xx with what was wrong, as text (E2B's SDK shows the body in its exception).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import AsyncGenerator
from typing import Any

import tornado.web
from tornado.iostream import StreamClosedError

from space.interpreter import PORT
from space.interpreter.kernels import Context, ContextError

log = logging.getLogger("space.interpreter")

MAX_BODY = 16 << 20
MAX_CONTEXTS = 16  # each is a kernel process: tens of MiB of the sandbox's memory
DEFAULT_CWD = "/home/user"
# Loaded into the default context before the template's snapshot, so no cell pays for it.
PRELOAD = "import matplotlib.pyplot, numpy"


class Contexts:
    """Every context by id, and the default one per language."""

    def __init__(self) -> None:
        self.by_id: dict[str, Context] = {}
        self.default: dict[str, Context] = {}

    async def start_default(self) -> None:
        context = await Context.start("python", _cwd(None), PRELOAD)
        self.by_id[context.id] = self.default["python"] = context

    async def new(self, language: str, cwd: str | None) -> Context:
        if len(self.by_id) >= MAX_CONTEXTS:
            raise ContextError(409, f"at most {MAX_CONTEXTS} contexts; remove one first")
        context = await Context.start(language, _cwd(cwd))
        self.by_id[context.id] = context
        return context

    def get(self, context_id: str) -> Context:
        try:
            return self.by_id[context_id]
        except KeyError:
            raise ContextError(404, f"context {context_id} not found") from None

    def for_cell(self, context_id: str | None, language: str | None) -> Context:
        if context_id and language:
            raise ContextError(400, "give context_id or language, not both")
        if context_id:
            return self.get(context_id)
        language = language or "python"
        if language not in self.default:
            raise ContextError(400, f"language {language!r} is not in this template; "
                                    f"it has {', '.join(self.default)}")  # fmt: skip
        return self.default[language]

    async def remove(self, context_id: str) -> None:
        context = self.get(context_id)
        if context in self.default.values():
            raise ContextError(409, "the default context cannot be removed; restart it instead")
        del self.by_id[context_id]
        await context.shutdown()


def _cwd(cwd: str | None) -> str:
    cwd = cwd or DEFAULT_CWD
    if not os.path.isabs(cwd):
        raise ContextError(400, f"cwd {cwd!r} must be an absolute path")
    os.makedirs(cwd, exist_ok=True)
    return cwd


class Handler(tornado.web.RequestHandler):
    @property
    def contexts(self) -> Contexts:
        return self.application.settings["contexts"]  # type: ignore[no-any-return]

    def body(self, **fields: type) -> dict[str, Any]:
        """The JSON object the request carries, each named field of its type (or absent)."""
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError as e:
            raise ContextError(400, f"the body is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ContextError(400, "the body must be a JSON object")
        for name, kind in fields.items():
            value = data.get(name)
            if value is not None and not isinstance(value, kind):
                raise ContextError(400, f"{name} must be a {kind.__name__}")
        return data

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        error = kwargs.get("exc_info", (None, None))[1]
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        if isinstance(error, ContextError):
            self.finish(error.why)
        elif status_code < 500:
            self.finish(self._reason)
        else:
            self.finish(f"{self._reason}; see the sandbox's /var/log/space-start.log")


class Health(Handler):
    def get(self) -> None:
        self.finish("ok")


class Execute(Handler):
    running: Context | None = None
    stopping: asyncio.Future[None] | None = None

    def on_connection_close(self) -> None:
        self._stop()

    def _stop(self) -> None:
        """Nobody waits for this cell any more: interrupt it (once: a second interrupt could
        land in the context's next cell), so the context is free again."""
        if self.running is not None and self.stopping is None:
            self.stopping = asyncio.ensure_future(self.running.interrupt())

    async def post(self) -> None:
        body = self.body(code=str, context_id=str, language=str, env_vars=dict)
        if not isinstance(body.get("code"), str):
            raise ContextError(400, "code (a string) is required")
        env = body.get("env_vars") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ContextError(400, "env_vars must map names to strings")
        context = self.contexts.for_cell(body.get("context_id"), body.get("language"))
        self.set_header("Content-Type", "application/x-ndjson")
        outputs: AsyncGenerator[dict[str, Any]] = context.execute(body["code"], env)
        self.running = context
        try:
            async for output in outputs:
                self.write(json.dumps(output) + "\n")
                await self.flush()
        except StreamClosedError:
            self._stop()
            await outputs.aclose()
        finally:
            self.running = None


class ContextList(Handler):
    async def post(self) -> None:
        body = self.body(language=str, cwd=str)
        context = await self.contexts.new(body.get("language") or "python", body.get("cwd"))
        self.finish(context.describe())

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps([c.describe() for c in self.contexts.by_id.values()]))


class ContextOne(Handler):
    async def delete(self, context_id: str) -> None:
        await self.contexts.remove(context_id)
        self.set_status(204)


class ContextRestart(Handler):
    async def post(self, context_id: str) -> None:
        context = self.contexts.get(context_id)
        preload = PRELOAD if context in self.contexts.default.values() else ""
        await context.restart(preload)
        self.set_status(204)


def application(contexts: Contexts) -> tornado.web.Application:
    return tornado.web.Application(
        [
            (r"/health", Health),
            (r"/execute", Execute),
            (r"/contexts", ContextList),
            (r"/contexts/([0-9a-f-]{1,64})", ContextOne),
            (r"/contexts/([0-9a-f-]{1,64})/restart", ContextRestart),
        ],
        contexts=contexts,
    )


async def serve(host: str = "127.0.0.1", port: int = PORT) -> None:
    contexts = Contexts()
    await contexts.start_default()
    server = application(contexts).listen(port, host, max_body_size=MAX_BODY)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    log.warning("code interpreter listening on %s:%d", host, port)
    await stop.wait()
    server.stop()
    for context in list(contexts.by_id.values()):
        await context.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    # Kernels inherit it: their debugger otherwise warns about frozen modules at every start.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    asyncio.run(serve(port=int(os.environ.get("SPACE_INTERPRETER_PORT", PORT))))

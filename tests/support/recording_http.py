"""A tiny OpenAI-compatible HTTP server on 127.0.0.1 that records every request it gets.

It runs on its own thread and event loop, so synchronous tests and worker subprocesses can
both reach it. Each request is recorded (method, path, headers, body) before it is answered;
with ``redirect_to`` set, every request is answered ``307`` to that URL instead.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RecordingServer:
    redirect_to: str | None = None
    reply: str = '{"answer": "ok"}'
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def netloc(self) -> str:
        return f"127.0.0.1:{self.port}"

    def authorizations(self) -> list[str | None]:
        """The ``Authorization`` (or ``x-api-key``) header of every request, in order."""
        return [r.headers.get("Authorization", r.headers.get("x-api-key")) for r in self.requests]

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(Recorded(request.method, request.path, dict(request.headers), body))
        if self.redirect_to is not None:
            raise web.HTTPTemporaryRedirect(self.redirect_to + request.path)
        if request.path.endswith("/chat/completions"):
            return web.json_response({
                "id": "c1", "object": "chat.completion",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": self.reply}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            })
        if request.path.endswith("/messages"):
            return web.json_response({
                "id": "m1", "type": "message", "role": "assistant", "model": "m",
                "content": [{"type": "text", "text": self.reply}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 5, "output_tokens": 2},
            })
        return web.Response(status=404, text=json.dumps({"error": "no such path"}))

    def start(self, timeout: float = 30) -> RecordingServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                app = web.Application()
                app.router.add_route("*", "/{tail:.*}", self._handle)
                self._runner = web.AppRunner(app)
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, "127.0.0.1", 0)
                loop.run_until_complete(site.start())
                server: Any = site._server
                self.port = server.sockets[0].getsockname()[1]
            except BaseException as exc:  # surfaced by start() below
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("recording server did not start")
        if errors:
            raise errors[0]
        return self

    def stop(self, timeout: float = 30) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

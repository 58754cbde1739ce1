"""A tiny OpenAI-compatible HTTP server on 127.0.0.1 that records every request it gets.

It runs on its own thread and event loop, so synchronous tests and worker subprocesses can
both reach it. Each request is recorded (method, path, headers, body) before it is answered;
with ``redirect_to`` set, every request is answered ``307`` to that URL instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from aiohttp import web

from tests.support.http_server import ThreadedServer


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
    _server: ThreadedServer | None = None

    @property
    def port(self) -> int:
        return 0 if self._server is None else self._server.port

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
        def routes(app: web.Application) -> None:
            app.router.add_route("*", "/{tail:.*}", self._handle)

        self._server = ThreadedServer(routes, name="recording-server").start(timeout)
        return self

    def stop(self, timeout: float = 30) -> None:
        if self._server is not None:
            self._server.stop(timeout)

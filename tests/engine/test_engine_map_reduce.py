"""Plan -> map -> reduce on the real engine: llama-server with SmolLM2-135M.

Asserts only what agentbatch decides, never the model's quality: one map agent per plan item
(as many as the plan gives), each item in its map result's
``input``, and the reduce prompt carrying every map output and failure. The requests are read
by a recording proxy in front of the server, so the test sees the prompts as the engine got
them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Annotated, Any

import aiohttp
import pytest
from aiohttp import web
from pydantic import BaseModel, Field

from agentbatch import AgentResult, run_with_map_reduce
from agentbatch.patterns.pipeline_error import PipelineError

pytestmark = pytest.mark.engine

MODEL = "smollm2"
PROXY_TIMEOUT_S = 600.0
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


class Fruits(BaseModel):
    # No maxItems: agentbatch's grammar leaves an array's upper bound open and checks it after
    # generation (backends/gbnf.py), so a bound here would test the model, not agentbatch.
    items: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1)


class Note(BaseModel):
    note: str = Field(max_length=60)


class Digest(BaseModel):
    digest: str = Field(max_length=80)


class RecordingProxy:
    """Forwards every request to ``upstream`` (buffered) and keeps each chat request's body."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.chats: list[dict[str, Any]] = []
        self.port: int | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path.endswith("/chat/completions"):
            self.chats.append(json.loads(body))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs,
                                         data=body, headers=headers) as resp:
            data = await resp.read()
            keep = {k: v for k, v in resp.headers.items()
                    if k.lower() not in _HOP and k.lower() != "content-encoding"}
            return web.Response(status=resp.status, body=data, headers=keep)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> web.AppRunner:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=PROXY_TIMEOUT_S), auto_decompress=True)
            app = web.Application(client_max_size=64 * 1024**2)
            app.router.add_route("*", "/{tail:.*}", self._forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return runner

        runner = self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._session.close())
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        assert self._ready.wait(60), "recording proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(60)

    def prompts(self, prefix: str) -> list[str]:
        """Distinct first user messages starting with ``prefix`` (one per agent)."""
        texts = []
        for body in self.chats:
            users = [m["content"] for m in body.get("messages", []) if m.get("role") == "user"]
            if users and isinstance(users[0], str) and users[0].startswith(prefix):
                texts.append(users[0])
        return list(dict.fromkeys(texts))


def map_reduce_through(proxy: RecordingProxy, scheme: str) -> None:
    """The test body, over any backend scheme the proxy fronts."""
    try:
        results, reduced = _run(proxy, scheme)
    except PipelineError as exc:
        # The model's plan did not validate (e.g. cut at max_tokens): agentbatch's decision is
        # then to stop at the plan stage, having sent nothing to any map agent.
        assert exc.stage == "plan", exc
        assert len(proxy.prompts("PLAN:")) == 1
        assert proxy.prompts("MAP:") == [] and proxy.prompts("REDUCE:") == []
        return
    _check(proxy, results, reduced)


def _run(proxy: RecordingProxy, scheme: str) -> tuple[list[AgentResult], Any]:
    return run_with_map_reduce(
        "PLAN: name a few fruits ({topic}).", {"topic": "short names"}, Fruits,
        "MAP: one short sentence about the fruit {item}.", Note,
        "REDUCE: you got {n} notes ({failed} failed); merge them into one line.", Digest,
        model=MODEL, backend=f"{scheme}://127.0.0.1:{proxy.port}", max_tokens=96,
        temperature=0.0, timeout_per_turn=300.0)


def _check(proxy: RecordingProxy, results: list[AgentResult], reduced: Any) -> None:
    assert len(proxy.prompts("PLAN:")) == 1
    items = [r.input["item"] for r in results]
    assert len(items) >= 1  # minItems is enforced by the grammar
    assert [r.index for r in results] == list(range(len(items)))
    assert sorted(proxy.prompts("MAP:")) == sorted(
        f"MAP: one short sentence about the fruit {item}." for item in dict.fromkeys(items))
    [prompt] = proxy.prompts("REDUCE:")
    failed = [r for r in results if not r.ok]
    assert prompt.startswith(f"REDUCE: you got {len(items)} notes ({len(failed)} failed);")
    lines = [json.loads(x) for x in prompt.splitlines() if x.startswith("{")]
    assert [x for x in lines if "output" in x] == [
        {"index": r.index, "output": r.output.model_dump(mode="json")}
        for r in results if r.ok]
    assert [(x["index"], x["kind"]) for x in lines if "kind" in x] == [
        (r.index, r.error.kind) for r in failed if r.error]
    assert isinstance(reduced, Digest | AgentResult)


def test_map_reduce_on_the_real_engine(llama_server: Any) -> None:
    with RecordingProxy(llama_server.http_url) as proxy:
        map_reduce_through(proxy, "llamacpp")

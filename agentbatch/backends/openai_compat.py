"""The OpenAI-compatible chat-completions backend (vLLM, SGLang, Dynamo, the simulator, OpenAI).

One pooled HTTP session per backend is shared by every agent: ``AiohttpSession`` by default,
``HttpSession`` (httpx) when a ``transport`` is injected. Non-streaming requests keep the
hot path simple; ``stream=True`` trades a little parsing for a measured time-to-first-token
and tool calls that can start before the reply ends (``sse.py``). The total
per-turn deadline is enforced around the whole exchange, not just per socket read.
``complete_batch`` sends many single-shot prompts as one ``/v1/completions`` call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from agentbatch.backends.aiohttp_session import AiohttpSession
from agentbatch.backends.base import Backend, BackendCapabilities, ServerLoad
from agentbatch.backends.batch_prompting import run_batch
from agentbatch.backends.http_session import HttpSession
from agentbatch.backends.loop_guard import LoopGuard
from agentbatch.backends.openai_parse import parse_chat_completion
from agentbatch.backends.prom import PrefixCounters, parse_server_load
from agentbatch.backends.sse import ON_TOOL_CALL, SSEDecoder, StreamAssembler, ToolCallListener
from agentbatch.backends.urls import OPENAI_HOST, BackendTarget, parse_backend_url
from agentbatch.core.errors import BackendError, BackendTimeout, BackendUnavailable, ServerError
from agentbatch.core.model_io import FINISH_LOOP, Message, ModelRequest, ModelResponse
from agentbatch.core.wait_for import wait_for

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
METRICS_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 5.0
CONTEXT_TIMEOUT_S = 10.0  # /v1/models and /tokenize: small, quick answers

_SELF_HOSTED = BackendCapabilities(
    native_json_schema=True, prefix_cache_metrics=True, prefix_warming=True, batch_prompting=True
)
# vLLM v1 caches a prefix block as it schedules it (``KVCacheManager.allocate_slots``): the
# first turns of a burst scheduled after the first one find the shared prefix already
# cached, as the simulator models. SGLang and Dynamo keep the one-token warm-up: whether
# they share a prefix among requests in flight was not checked.
_VLLM = dataclasses.replace(_SELF_HOSTED, prefix_shared_in_flight=True)
CAPABILITIES: dict[str, BackendCapabilities] = {
    "vllm": _VLLM,
    "sglang": _SELF_HOSTED,
    "sim": _VLLM,
    "dynamo": BackendCapabilities(native_json_schema=True, prefix_warming=True, agent_hints=True),
    "openai": BackendCapabilities(native_json_schema=True, max_safe_concurrency=64),
    # A generic OpenAI-compatible server: most honour json_schema; assume nothing else.
    "http": BackendCapabilities(native_json_schema=True),
}

_SCHEMA_NAME_RE = re.compile(r"[^A-Za-z0-9_-]")


def _header_safe(value: str) -> str:
    """Header values must be single-line ASCII; ids are ours, so drop anything else."""
    if value.isascii() and value.isprintable():  # every id we make: nothing to drop
        return value  # (printable ASCII is exactly 32..126)
    return "".join(ch for ch in value if 32 <= ord(ch) < 127)


def response_format(json_schema: dict[str, Any]) -> dict[str, Any]:
    """``ModelRequest.json_schema`` as an OpenAI ``response_format`` (a bare schema is accepted)."""
    schema = json_schema.get("schema") if "schema" in json_schema else json_schema
    name = _SCHEMA_NAME_RE.sub("_", str(json_schema.get("name") or "output"))[:64]
    spec: dict[str, Any] = {"name": name or "output", "schema": schema}
    if "strict" in json_schema:
        spec["strict"] = bool(json_schema["strict"])
    return {"type": "json_schema", "json_schema": spec}


class OpenAICompatBackend(Backend):
    """``Backend`` over ``POST {base}/v1/chat/completions``.

    ``stream=True`` asks for SSE (with ``stream_options.include_usage``) and fills
    ``ModelResponse.ttft_s``; a streamed JSON reply that loops inside a string is stopped
    there (``finish_reason="loop"``, answered like a cut-off reply) unless
    ``stop_loops=False``; ``on_tool_call`` (or, per task, the ``sse.ON_TOOL_CALL`` context
    variable, which wins) hears each tool call as soon as its arguments are complete.
    """

    def __init__(
        self,
        target: BackendTarget | str,
        *,
        timeout: float | None = None,
        max_connections: int = 1000,
        api_key: str | None = None,
        capabilities: BackendCapabilities | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        stream: bool = False,
        stop_loops: bool = True,
        on_tool_call: ToolCallListener | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if isinstance(target, str):
            target = parse_backend_url(target, api_key=api_key)
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.target = target
        self.name = target.display
        self.capabilities = capabilities or CAPABILITIES.get(target.scheme, CAPABILITIES["http"])
        self.timeout = float(timeout) if timeout else DEFAULT_TIMEOUT_S
        self.max_connections = max_connections
        self.stream = stream
        self.stop_loops = stop_loops
        self.on_tool_call = on_tool_call
        self._clock = clock
        self._api_key = api_key or target.api_key
        headers = {"User-Agent": "agentbatch"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        # aiohttp by default: at hundreds of concurrent turns it costs ~30x less CPU per
        # request than httpx (benchmarks/results/http_clients.json). An injected httpx
        # transport (tests, custom routing) keeps the httpx session.
        self._session: HttpSession | AiohttpSession
        if transport is not None:
            self._session = HttpSession(target.base_url, who=self.name, headers=headers,
                                        timeout=self.timeout, max_connections=max_connections,
                                        secret=self._api_key, transport=transport)
        else:
            self._session = AiohttpSession(target.base_url, who=self.name, headers=headers,
                                           timeout=self.timeout, max_connections=max_connections,
                                           secret=self._api_key)
        self._prefix_counters: PrefixCounters | None = None
        self._context: int | None = None  # context_length, once the server answered
        self._context_learnt = False
        self._context_asking: asyncio.Task[None] | None = None  # the one GET in flight
        self._counts = True  # False once the server showed it has no usable /tokenize
        # OpenAI's reasoning models reject max_tokens; every other server expects it.
        self._max_tokens_field = (
            "max_completion_tokens" if target.host == OPENAI_HOST else "max_tokens"
        )

    @property
    def base_url(self) -> str:
        return self.target.base_url

    @property
    def requests_sent(self) -> int:
        """HTTP requests sent for model calls (chat, streamed or batched), for stats."""
        return self._session.requests_sent

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # -- hooks for scheme-specific behaviour -------------------------------------------------

    def _extra_body(self, request: ModelRequest) -> dict[str, Any]:
        """Scheme-specific request fields (e.g. Dynamo's ``nvext``); none by default."""
        return {}

    def _extra_headers(self, request: ModelRequest) -> dict[str, str]:
        """Scheme-specific request headers; none by default."""
        return {}

    # -- Backend protocol -------------------------------------------------------------------

    def build_body(self, request: ModelRequest) -> dict[str, Any]:
        """The JSON body for one chat-completions call (public so engines/tests can inspect it)."""
        body: dict[str, Any] = {
            "model": request.model or self.target.model or "",
            "messages": request.messages,
        }
        if request.tools:
            body["tools"] = request.tools
            if request.tool_choice is not None:  # OpenAI rejects tool_choice without tools
                body["tool_choice"] = request.tool_choice
        if request.max_tokens is not None:
            body[self._max_tokens_field] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.json_schema and self.capabilities.native_json_schema:
            body["response_format"] = response_format(request.json_schema)
        body.update(self._extra_body(request))
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def _headers(self, request: ModelRequest) -> dict[str, str]:
        headers: dict[str, str] = {}
        if request.request_id:
            headers["X-Request-Id"] = _header_safe(request.request_id)
        headers.update(self._extra_headers(request))
        return headers

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One model turn. Raises ``BackendError`` subclasses, never httpx exceptions."""
        timeout = request.timeout_s or self.timeout
        if self.stream:
            return await self._complete_streaming(request, timeout)
        body = await self._session.post_json(
            "/v1/chat/completions", self.build_body(request), self._headers(request), timeout
        )
        return parse_chat_completion(body, request_id=request.request_id, who=self.name)

    async def _complete_streaming(self, request: ModelRequest, timeout: float) -> ModelResponse:
        assembler = StreamAssembler(
            request_id=request.request_id,
            on_tool_call=ON_TOOL_CALL.get() or self.on_tool_call,
            who=self.name,
        )
        decoder = SSEDecoder()
        started = self._clock()
        ttft: float | None = None
        # A JSON reply whose string value loops is stopped (loop_guard.py): leaving the
        # stream unread closes the connection, and the server stops generating.
        guard = LoopGuard() if request.json_schema and self.stop_loops else None
        seen = 0  # assembler.text_parts already shown to the guard

        def feed(events: list[str]) -> None:
            nonlocal ttft, seen
            for data in events:
                if assembler.feed_data(data) and ttft is None:
                    ttft = self._clock() - started
            if guard is not None and len(assembler.text_parts) > seen:
                pieces, seen = assembler.text_parts[seen:], len(assembler.text_parts)
                if guard.feed("".join(pieces)) and assembler.finish_reason is None:
                    assembler.finish_reason = FINISH_LOOP

        async def read() -> None:
            async with self._session.post_lines(
                "/v1/chat/completions", self.build_body(request), self._headers(request), timeout
            ) as lines:
                async for line in lines:
                    feed(decoder.feed(line))
                    if assembler.done or assembler.finish_reason == FINISH_LOOP:
                        return
            feed(decoder.flush())

        try:
            await wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"{self.name}: stream not finished within {timeout:g}s") from None
        if not assembler.done and assembler.finish_reason is None:
            raise ServerError(f"{self.name}: stream ended before [DONE]", status=200)
        response = assembler.finish()
        response.ttft_s = ttft
        return response

    async def warm(self, request: ModelRequest) -> None:
        """Send the shared prefix once (``max_tokens=1``) so the fan-out hits a warm cache.
        Where the server shares a prefix among requests in flight, the round trip would only
        delay the fan-out (a forward pass on a busy server): this only checks it answers."""
        if self.capabilities.prefix_shared_in_flight:
            if not await self.health():
                raise BackendUnavailable(
                    f"{self.name}: no answer from {self.target.base_url} on /health or "
                    "/v1/models")
            return
        update: dict[str, Any] = {"max_tokens": 1, "json_schema": None}
        if request.request_id:
            update["request_id"] = f"{request.request_id}:warm"
        await self.complete(request.model_copy(update=update))

    async def health(self) -> bool:
        """Whether the server answers: ``GET /health`` is 200, else ``GET /v1/models`` is.

        Never raises; the endpoint pool uses it to re-admit an ejected server.
        """
        status = await self._session.get_status("/health", HEALTH_TIMEOUT_S)
        if status is None:
            return False
        if status == 200:
            return True
        return await self._session.get_status("/v1/models", HEALTH_TIMEOUT_S) == 200

    async def fetch_load(self) -> ServerLoad | None:
        """The server's own queue from ``{base}/metrics``; None when it has none to offer.

        Never raises: load is advisory, and a down server shows up in ``complete`` anyway.
        """
        if self.target.scheme == "openai":
            return None
        text = await self._session.get_text("/metrics", METRICS_TIMEOUT_S)
        if text is None:
            log.debug("%s: /metrics unavailable", self.name)
            return None
        load, counters = parse_server_load(text, self._prefix_counters)
        if counters is not None:
            self._prefix_counters = counters
        return load

    # -- context length and token counts ---------------------------------------------------

    async def context_length(self) -> int | None:
        """The context the server states, learnt once (``_learn_context``); None when it
        states none. A server that does not answer now is asked again next time.

        The first turns of every agent arrive together: one asks and all of them await that
        one answer, woken at once. (A lock woke them one per loop pass, which spread a
        200-agent batch's first requests over a second: issue 26 item 5.) The ask is
        shielded, so an agent cancelled while waiting does not cancel it for the others."""
        if self._context_learnt:
            return self._context
        asking = self._context_asking
        if asking is None or asking.get_loop() is not asyncio.get_running_loop():
            asking = self._context_asking = asyncio.ensure_future(self._ask_context())
        await asyncio.shield(asking)
        return self._context

    async def _ask_context(self) -> None:
        try:
            answered, context = await self._learn_context()
            self._context, self._context_learnt = context, answered
        finally:  # unanswered (or failed): the next turn asks again
            self._context_asking = None

    async def _learn_context(self) -> tuple[bool, int | None]:
        """(answered, context): the smallest ``max_model_len`` on ``GET /v1/models`` (vLLM,
        SGLang, the simulator); OpenAI's listing states none."""
        if self.target.scheme == "openai":
            return True, None
        text = await self._session.get_text("/v1/models", CONTEXT_TIMEOUT_S)
        if text is None:
            return False, None
        try:
            data = json.loads(text).get("data")
            lengths = [int(m["max_model_len"]) for m in data
                       if isinstance(m, dict) and isinstance(m.get("max_model_len"), int)]
        except (ValueError, AttributeError, TypeError):
            return True, None
        return True, min(lengths) if lengths else None

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        """vLLM's ``POST /tokenize`` (messages through the chat template, tools included);
        None, so the engine estimates, where the server has no such endpoint."""
        if self.target.scheme == "openai" or not self._counts:
            return None
        body: dict[str, Any] = ({"prompt": prompt} if isinstance(prompt, str) else
                                {"messages": prompt, "add_generation_prompt": True})
        if tools and not isinstance(prompt, str):
            body["tools"] = tools
        if self.target.model:
            body["model"] = self.target.model
        return await self._post_count("/tokenize", body)

    async def _post_count(self, path: str, body: dict[str, Any]) -> int | None:
        """The token count of ``POST path``; an endpoint that refuses stops being asked."""
        try:
            reply = await self._session.post_json(path, body, {}, CONTEXT_TIMEOUT_S,
                                                  model_request=False)
        except BackendError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status != 429:
                log.info("%s: %s answered HTTP %s: prompt sizes are estimated", self.name,
                         path, exc.status)
                self._counts = False
            return None
        tokens = reply.get("tokens") if isinstance(reply, dict) else None
        if isinstance(reply, dict) and isinstance(reply.get("count"), int):
            return int(reply["count"])
        return len(tokens) if isinstance(tokens, list) else None

    # -- batch prompting --------------------------------------------------------------------

    async def complete_batch(
        self,
        prompts: list[str],
        *,
        model: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        json_schema: dict[str, Any] | None = None,
        request_id: str = "",
        messages: list[list[dict[str, Any]]] | None = None,
    ) -> list[ModelResponse | BackendError]:
        """Complete ``prompts`` with ONE ``/v1/completions`` call; a result or error per prompt.

        Drivers shape the call through three hooks: ``_batch_prompts`` (the prompts to send,
        e.g. rendered with the server's template when the conversations are given in
        ``messages``), ``_batch_schema`` (how the schema travels) and ``_batch_prefill`` (a
        start every valid reply shares, appended to each prompt and put back in front of
        each reply, as jump-forward does on chat turns). Here prompts go as the caller
        rendered them, the schema as ``response_format``, which vLLM and SGLang read on
        ``/v1/completions``, and nothing is prefilled.

        If the batched call fails for any reason, each prompt is retried alone (concurrently),
        so one bad prompt never fails its siblings. Never raises ``BackendError``.
        """
        if not prompts:
            return []
        model = model or self.target.model or ""
        prompts, extra = await self._batch_prompts(prompts, messages, model)
        fmt = None
        prefill = ""
        if json_schema and self.capabilities.native_json_schema:
            fmt, schema_extra = self._batch_schema(json_schema)
            extra = {**extra, **schema_extra}
            prefill = self._batch_prefill(json_schema)
        replies = await run_batch(
            self._session.post_json,
            [prompt + prefill for prompt in prompts],
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            response_format=fmt,
            request_id=_header_safe(request_id),
            timeout=self.timeout,
            who=self.name,
            extra_body=extra or None,
        )
        if not prefill:
            return replies
        # completions return only what follows the prompt: the prefilled start goes back on
        return [r.model_copy(update={"text": prefill + (r.text or "")})
                if isinstance(r, ModelResponse) else r for r in replies]

    async def _batch_prompts(self, prompts: list[str], messages: list[list[Message]] | None,
                             model: str) -> tuple[list[str], dict[str, Any]]:
        """(the prompts to send, extra body fields): as given, here."""
        return prompts, {}

    def _batch_schema(self, json_schema: dict[str, Any]
                      ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """(``response_format``, extra body fields) carrying the schema on completions."""
        return response_format(json_schema), {}

    def _batch_prefill(self, json_schema: dict[str, Any]) -> str:
        """The text every reply to ``json_schema`` starts with, sent as part of each prompt
        instead of decoded; ``""`` here (``_batch_schema`` must then constrain the rest)."""
        return ""

    async def aclose(self) -> None:
        """Close the pooled connections. Safe to call twice, or before first use."""
        await self._session.aclose()

    async def __aenter__(self) -> OpenAICompatBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class DynamoBackend(OpenAICompatBackend):
    """NVIDIA Dynamo frontend: OpenAI-compatible plus per-request agent hints.

    We send ``nvext.agent_hints`` = {turns_left, speculative_prefill, osl} and the agent's
    stable key as ``x-dynamo-session-id``. ``agent_hints.turns_left`` is what agentbatch's own
    docs promise (the predecessor SDK sent it and it was live-tested); ``speculative_prefill``
    (another turn will follow, so Dynamo may pre-fill the next prefix) and ``osl`` (expected
    output length) are Dynamo's documented fields. Which hints a server acts on varies by
    Dynamo version; unknown ones are ignored by the frontend.
    """

    def _extra_body(self, request: ModelRequest) -> dict[str, Any]:
        hints: dict[str, Any] = {
            "turns_left": request.turns_left,
            "speculative_prefill": request.turns_left > 1,
        }
        if request.max_tokens is not None:
            hints["osl"] = request.max_tokens
        return {"nvext": {"agent_hints": hints}}

    def _extra_headers(self, request: ModelRequest) -> dict[str, str]:
        if request.agent_key:
            return {"x-dynamo-session-id": _header_safe(request.agent_key)}
        return {}

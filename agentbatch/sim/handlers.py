"""HTTP handlers: parse, plan (script), inject faults, schedule (engine), shape the reply."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from agentbatch.core.model_io import Message, canonical_json
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.engine import QueueFull, Sequence
from agentbatch.sim.faults import HTTP_FAULTS, Fault, faulted_reply, faulted_text
from agentbatch.sim.model import completion_cost, plan_chat, plan_completion
from agentbatch.sim.openai_shapes import (
    SSE_DONE,
    ChunkMaker,
    chat_completion,
    chat_deltas,
    error_body,
    split_text,
    sse,
    text_completion,
    usage,
)
from agentbatch.sim.script import Reply
from agentbatch.sim.state import SimState
from agentbatch.sim.tokens import (
    TEMPLATE_TURN,
    block_hashes,
    count_tokens,
    decode,
    encode,
    render_chat,
    render_template,
)

STATE = web.AppKey("agentbatch_sim_state", SimState)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _error(status: int, message: str, type_: str, retry_after: str | None = None) -> web.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else None
    return web.json_response(error_body(message, type_, status), status=status, headers=headers)


async def _read_body(request: web.Request, state: SimState) -> dict[str, Any] | web.Response:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        state.stats.bad_requests += 1
        return _error(400, "request body must be a JSON object", "BadRequestError")
    if not state.model_ok(body.get("model")):
        state.stats.bad_requests += 1
        return _error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
    return body


def _fault_response(fault: Fault | None) -> web.Response | None:
    """The error response for an HTTP-level fault, else None."""
    if fault is None or fault.kind not in HTTP_FAULTS:
        return None
    if fault.kind == "http_429":
        return _error(429, "simulated rate limit", "RateLimitError", fault.retry_after)
    return _error(500, "simulated internal server error", "InternalServerError")


async def _hold(state: SimState, fault: Fault | None) -> None:
    """A ``timeout`` fault holds the request (clients should give up first), then serves it."""
    if fault is not None and fault.kind == "timeout":
        await asyncio.sleep(state.config.timeout_hold_s)


def _queue_full(state: SimState) -> web.Response:
    state.stats.rejected_queue_full += 1
    return _error(
        429, "waiting queue is full", "RateLimitError", str(state.config.queue_full_retry_after_s)
    )


def _finished(state: SimState, seqs: list[Sequence], t0: float) -> None:
    state.stats.ttft.observe(max(0.0, min(s.first_token.result() for s in seqs) - t0))
    state.stats.completion_tokens += sum(s.completion_tokens for s in seqs)
    state.stats.success += 1


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    t0 = asyncio.get_running_loop().time()
    body = await _read_body(request, state)
    if isinstance(body, web.Response):
        return body
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        state.stats.bad_requests += 1
        return _error(400, "`messages` must be a non-empty list of objects", "BadRequestError")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if (too_long := _over_context(state, messages, body.get("tools"), max_tokens)) is not None:
        return too_long
    n = state.next_request("chat_completions")
    plan = plan_chat(body)
    state.stats.chat_by_agent[plan.agent_key] += 1
    fault = state.decide_fault(plan.agent_key, plan.script.fails, n)
    if (response := _fault_response(fault)) is not None:
        return response
    await _hold(state, fault)
    reply = plan.reply
    if fault is not None and fault.kind not in HTTP_FAULTS and fault.kind != "timeout":
        reply = faulted_reply(fault.kind, reply, plan.pending, plan.agent_key)
    prompt = render_chat(messages, body.get("tools"))
    seq = Sequence(
        count_tokens(prompt),
        block_hashes(prompt),
        completion_cost(plan.script, reply.cost_text, max_tokens),
    )
    try:
        state.engine.submit(seq)
    except QueueFull:
        return _queue_full(state)
    model = str(body.get("model") or state.config.models[0])
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    try:
        if body.get("stream"):
            return await _stream_chat(
                request,
                state,
                seq,
                reply,
                t0,
                ChunkMaker(rid, model, created, True, _include_usage(body)),
            )
        await seq.done
    finally:
        state.engine.cancel(seq)  # no-op once finished; a cancelled await also cancels seq.done
    _finished(state, [seq], t0)
    use = usage(seq.prompt_tokens, seq.cached_tokens, seq.completion_tokens)
    return web.json_response(chat_completion(rid, model, created, reply, use))


def context_tokens(messages: list[Message], tools: Any = None) -> int:
    """A chat prompt's size in ``/tokenize`` tokens: its template rendering, tools included."""
    text = render_template(messages)
    if isinstance(tools, list) and tools:
        text += TEMPLATE_TURN.format(role="tools", content=canonical_json(tools))
    return len(encode(text))


def _over_context(state: SimState, messages: list[Message], tools: Any,
                  max_tokens: Any) -> web.Response | None:
    """vLLM's HTTP 400 for a prompt (plus ``max_tokens``) longer than ``max_model_len``."""
    limit = state.config.max_model_len
    prompt = context_tokens(messages, tools)
    completion = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0
    if prompt + completion <= limit and prompt < limit:
        return None
    state.stats.bad_requests += 1
    return _error(400, f"This model's maximum context length is {limit} tokens. However, you "
                  f"requested {prompt + completion} tokens ({prompt} in the messages, "
                  f"{completion} in the completion). Please reduce the length of the messages "
                  "or completion.", "BadRequestError")


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


async def _stream_chat(
    request: web.Request, state: SimState, seq: Sequence, reply: Reply, t0: float, maker: ChunkMaker
) -> web.StreamResponse:
    """Send deltas as the engine decodes: role at the first token, the rest pro rata."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    deltas = chat_deltas(reply)
    await seq.first_token
    await resp.write(sse(maker.chat({"role": "assistant", "content": ""})))
    sent = 0
    while True:
        seq.progress.clear()
        finished = seq.done.done()
        target = (
            len(deltas)
            if finished
            else min(len(deltas), max(1, len(deltas) * seq.generated // seq.completion_tokens))
        )
        if target > sent:
            await resp.write(b"".join(sse(maker.chat(d)) for d in deltas[sent:target]))
            sent = target
        if finished:
            break
        await seq.progress.wait()
    tail = [sse(maker.chat({}, reply.finish_reason))]
    if maker.include_usage:
        tail.append(
            sse(maker.usage(usage(seq.prompt_tokens, seq.cached_tokens, seq.completion_tokens)))
        )
    await resp.write(b"".join([*tail, SSE_DONE]))
    _finished(state, [seq], t0)
    await resp.write_eof()
    return resp


def _prompts(body: dict[str, Any]) -> list[str] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    return None


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    t0 = asyncio.get_running_loop().time()
    body = await _read_body(request, state)
    if isinstance(body, web.Response):
        return body
    prompts = _prompts(body)
    if prompts is None:
        state.stats.bad_requests += 1
        return _error(
            400, "`prompt` must be a string or a non-empty list of strings", "BadRequestError"
        )
    state.stats.recent_completions.append(body)  # other fields (add_special_tokens) ignored
    n = state.next_request("completions")
    texts, costs, hold = [], [], None
    for i, prompt in enumerate(prompts):
        plan = plan_completion(prompt, body)
        fault = state.decide_fault(plan.agent_key, plan.script.fails, n, i)
        text = plan.text
        if (response := _fault_response(fault)) is not None:
            return response
        if fault is not None and fault.kind == "timeout":
            hold = fault
        elif fault is not None:
            text = faulted_text(fault.kind, text)
        texts.append(text)
        costs.append(completion_cost(plan.script, text, body.get("max_tokens")))
    await _hold(state, hold)
    seqs = [
        Sequence(count_tokens(p), block_hashes(p), cost)
        for p, cost in zip(prompts, costs, strict=True)
    ]
    try:
        for seq in seqs:
            state.engine.submit(seq)
    except QueueFull:
        for seq in seqs:
            state.engine.cancel(seq)
        return _queue_full(state)
    model = str(body.get("model") or state.config.models[0])
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    try:
        if body.get("stream"):
            maker = ChunkMaker(rid, model, created, False, _include_usage(body))
            return await _stream_completions(request, state, seqs, texts, t0, maker)
        await asyncio.gather(*(s.done for s in seqs))
    finally:
        for seq in seqs:
            state.engine.cancel(seq)  # no-op for finished sequences
    _finished(state, seqs, t0)
    return web.json_response(text_completion(rid, model, created, texts, _usage_of(seqs)))


def _usage_of(seqs: list[Sequence]) -> dict[str, Any]:
    return usage(
        sum(s.prompt_tokens for s in seqs),
        sum(s.cached_tokens for s in seqs),
        sum(s.completion_tokens for s in seqs),
    )


async def _stream_completions(
    request: web.Request,
    state: SimState,
    seqs: list[Sequence],
    texts: list[str],
    t0: float,
    maker: ChunkMaker,
) -> web.StreamResponse:
    """Stream each prompt's text in index order, once that sequence has finished."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    for i, (seq, text) in enumerate(zip(seqs, texts, strict=True)):
        await seq.done
        chunks = [sse(maker.text(i, piece)) for piece in split_text(text)]
        chunks.append(sse(maker.text(i, "", "stop")))
        await resp.write(b"".join(chunks))
    tail = [sse(maker.usage(_usage_of(seqs)))] if maker.include_usage else []
    await resp.write(b"".join([*tail, SSE_DONE]))
    _finished(state, seqs, t0)
    await resp.write_eof()
    return resp


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's ``/tokenize``: ``messages`` through the sim's chat template (``render_template``),
    or a raw ``prompt``; one token per code point."""
    state = request.app[STATE]
    body = await _read_body(request, state)
    if isinstance(body, web.Response):
        return body
    messages, prompt = body.get("messages"), body.get("prompt")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        text = render_template(messages, body.get("add_generation_prompt") is not False)
        tools = body.get("tools")
        if isinstance(tools, list) and tools:  # as vLLM's chat /tokenize renders them
            text += TEMPLATE_TURN.format(role="tools", content=canonical_json(tools))
    elif isinstance(prompt, str):
        text = prompt
    else:
        state.stats.bad_requests += 1
        return _error(400, "give `messages` (a non-empty list of objects) or a `prompt` string",
                      "BadRequestError")
    state.stats.template_requests["tokenize"] += 1
    tokens = encode(text)
    return web.json_response({"tokens": tokens, "count": len(tokens),
                              "max_model_len": state.config.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's ``/detokenize``: the text of ``tokens`` (``encode`` reversed)."""
    state = request.app[STATE]
    body = await _read_body(request, state)
    if isinstance(body, web.Response):
        return body
    tokens = body.get("tokens")
    try:
        text = decode(tokens) if isinstance(tokens, list) else None
    except ValueError:
        text = None
    if text is None:
        state.stats.bad_requests += 1
        return _error(400, "`tokens` must be a list of code points", "BadRequestError")
    state.stats.template_requests["detokenize"] += 1
    return web.json_response({"prompt": text})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "agentbatch-sim", "root": m,
         "max_model_len": state.config.max_model_len}
        for m in state.config.models
    ]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def metrics(request: web.Request) -> web.Response:
    text = request.app[STATE].metrics_text()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


async def sim_stats(request: web.Request) -> web.Response:
    """The counters, and ``batch_billed``: what the batch APIs billed, per model
    (``BatchApiState.billed``)."""
    stats = request.app[STATE].stats.as_dict()
    stats["batch_billed"] = request.app[BATCH_API].billed()
    return web.json_response(stats, dumps=json.dumps)


async def sim_batch_jobs(request: web.Request) -> web.Response:
    """Every provider batch's timeline as the simulator decided it
    (``BatchApiState.timeline``)."""
    return web.json_response(request.app[BATCH_API].timeline(), dumps=json.dumps)


async def sim_reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    request.app[BATCH_API].reset_billed()
    return web.json_response({"ok": True})

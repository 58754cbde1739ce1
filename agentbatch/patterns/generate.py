"""``generate_batch``: one completion per prompt, in order, for callers with their own agent loop.

This is the low-level call (seed 004): no agent loop, no tools, no repair turn. Where every
endpoint of the pool takes a list of prompts (vLLM, SGLang, llama.cpp, the simulator), the
prompts travel batched in ``/v1/completions`` requests: ``MicroBatchingBackend`` gathers the
concurrent calls, renders each with the server's chat template (ChatML where the server
cannot tell), and falls back to one call per prompt if a batched request fails. Elsewhere
each prompt is its own concurrent chat call. Either way each prompt is a one-message
conversation, so both paths send the model the same thing, and the retry layer and the
endpoint pool of ``open_backend`` apply as they do to a batch.

Embedded only: there is no agent state to keep, so nothing here goes through Redis.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from agentbatch.backends.setup import open_backend
from agentbatch.core.errors import BackendError, BatchSpecError
from agentbatch.core.model_io import Message, ModelRequest
from agentbatch.core.output import OutputContract
from agentbatch.core.results import AgentError, AgentResult
from agentbatch.patterns.endpoints import check_prompts, endpoint_urls, pool_can_batch

DEFAULT_MAX_INFLIGHT = 256


def _check(output_schema: Any, max_tokens: Any, temperature: Any, max_inflight: Any,
           timeout: Any) -> None:
    if output_schema is not None and not (
            isinstance(output_schema, type) and issubclass(output_schema, BaseModel)):
        raise BatchSpecError(f"generate_batch: output_schema must be a Pydantic model class, "
                             f"got {output_schema!r}")
    for name, value in (("max_tokens", max_tokens), ("max_inflight", max_inflight)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise BatchSpecError(f"generate_batch: {name} must be an int >= 1, got {value!r}")
    for name, value in (("temperature", temperature), ("timeout", timeout)):
        if value is None:
            continue
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not math.isfinite(value) or value < 0 or (name == "timeout" and value == 0)):
            raise BatchSpecError(f"generate_batch: {name} must be a finite number "
                                 f"{'> 0' if name == 'timeout' else '>= 0'}, got {value!r}")


def _messages(prompt: str, system_prompt: str | None, contract: OutputContract
              ) -> list[Message]:
    system = "\n\n".join(s for s in (system_prompt, contract.instructions()) if s)
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    return messages


async def agenerate_batch(
    prompts: Sequence[str],
    *,
    backend: str | Sequence[str] | None = None,
    model: str | None = None,
    output_schema: type[BaseModel] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    system_prompt: str | None = None,
    max_inflight: int | None = None,
    timeout: float | None = 120.0,
    batch_prompting: bool | None = None,
) -> list[AgentResult]:
    """One ``AgentResult`` per prompt, in prompt order; a failed prompt is a result with
    ``ok=False`` and ``error`` (kind ``invalid_output`` when the reply does not fit
    ``output_schema``), never an exception.

    Args:
        prompts: the user messages, one completion each.
        backend: a URL, a list of URLs or ``"@hostfile"`` (env ``AGENTBATCH_BACKEND``).
        model: the model name (env ``AGENTBATCH_MODEL``).
        output_schema: a Pydantic model each reply must validate against (sent as the
            server's JSON schema where it takes one); ``output`` is then an instance.
        max_tokens, temperature: per completion (None: the server's default).
        system_prompt: sent before every prompt.
        max_inflight: prompts in flight at once (default 256).
        timeout: seconds per prompt, retries included.
        batch_prompting: None (default) batches when every endpoint can; False never does.

    Raises:
        BatchSpecError: a bad argument, named; nothing has been sent.
    """
    prompts = check_prompts(prompts, who="generate_batch")
    urls = endpoint_urls(backend, who="generate_batch")
    model = model or os.environ.get("AGENTBATCH_MODEL")
    if not model:
        raise BatchSpecError("generate_batch: model is required (or set AGENTBATCH_MODEL)")
    _check(output_schema, max_tokens, temperature, max_inflight, timeout)
    if not prompts:
        return []
    if batch_prompting is None:
        batch_prompting = pool_can_batch(urls)
    contract = OutputContract(output_schema)
    json_schema = ({"name": contract.name, "schema": contract.json_schema}
                   if output_schema is not None else None)
    gate = asyncio.Semaphore(max_inflight or DEFAULT_MAX_INFLIGHT)
    run_id = uuid.uuid4().hex[:12]
    client = open_backend(urls, timeout=timeout, batch_prompting=batch_prompting)

    async def one(i: int, prompt: str) -> AgentResult:
        request = ModelRequest(
            model=model, messages=_messages(prompt, system_prompt, contract),
            json_schema=json_schema, max_tokens=max_tokens, temperature=temperature,
            request_id=f"gen-{run_id}-{i}", timeout_s=timeout)
        started = time.perf_counter()
        async with gate:
            try:
                reply = await client.complete(request)
            except BackendError as exc:
                return AgentResult(index=i, input={"prompt": prompt}, ok=False, turns=1,
                                   error=AgentError(kind=exc.kind, message=str(exc)),
                                   latency_s=time.perf_counter() - started)
        parsed = contract.parse(reply.text)
        return AgentResult(
            index=i, input={"prompt": prompt}, ok=parsed.ok, text=reply.text, turns=1,
            output=contract.instance(parsed.value) if parsed.ok else None,
            error=None if parsed.ok else AgentError(kind="invalid_output",
                                                    message=parsed.error or ""),
            usage=reply.usage, latency_s=time.perf_counter() - started, ttft_s=reply.ttft_s)

    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        await client.aclose()


def generate_batch(prompts: Sequence[str], **kwargs: Any) -> list[AgentResult]:
    """``agenerate_batch`` for synchronous code (same arguments); from inside an event loop,
    await ``agenerate_batch`` instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(agenerate_batch(prompts, **kwargs))
    raise RuntimeError("generate_batch() was called inside a running event loop; "
                       "use 'await agenerate_batch(...)' there")

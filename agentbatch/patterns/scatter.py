"""aurora-swarm's scatter-gather and broadcast, as agentbatch batches over an endpoint pool.

``scatter_gather`` is one batch of single-turn agents (``task="{prompt}"``, ``max_turns=1``):
the pool spreads them (least outstanding first), a reply that misses ``output_schema`` gets
the usual repair turn, failures are results, and the batch runs on either engine (the
distributed one when ``redis_url`` is given). Where every endpoint can take a list of prompts
the turns are gathered into batched ``/v1/completions`` requests (``batch_prompting``).

``broadcast`` sends one prompt to every endpoint: one single-agent batch per endpoint, run
concurrently, so each answer says which server gave it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from agentbatch.api import arun_batch, run_batch
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.patterns.endpoints import check_prompts, endpoint_urls, pool_can_batch

TASK = "{prompt}"
# run_batch arguments these patterns set themselves: a caller's value would be overridden.
_FIXED = ("task", "inputs", "max_turns", "tools", "tool_calling", "tool_choice")


def _check_extra(who: str, extra: dict[str, Any]) -> None:
    for key in _FIXED:
        if key in extra:
            raise BatchSpecError(
                f"{who}: {key}= does not apply: each prompt is one single-turn agent with no "
                "tools; use run_batch for multi-turn or tool-using agents")


def _scatter_kwargs(prompts: Any, backend: Any, model: str | None, max_tokens: int | None,
                    output_schema: type[BaseModel] | None, extra: dict[str, Any]
                    ) -> dict[str, Any]:
    prompts = check_prompts(prompts, who="scatter_gather")
    urls = endpoint_urls(backend, who="scatter_gather")  # an empty pool fails here
    _check_extra("scatter_gather", extra)
    extra.setdefault("batch_prompting", pool_can_batch(urls))
    return dict(task=TASK, inputs=[{"prompt": p} for p in prompts], backend=urls,
                model=model, max_tokens=max_tokens, output_schema=output_schema, max_turns=1,
                **extra)


def scatter_gather(
    prompts: Sequence[str],
    *,
    backend: str | Sequence[str] | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    output_schema: type[BaseModel] | None = None,
    **batch_kwargs: Any,
) -> list[AgentResult]:
    """One single-turn agent per prompt over the pool; results in input order.

    ``backend`` is a URL, a list of URLs or ``"@hostfile"``; an empty pool raises
    ``BatchSpecError`` before anything is sent. Any other ``run_batch`` keyword applies
    (``redis_url``, ``system_prompt``, ``max_inflight``, ``batch_prompting`` ...) except
    ``tools``/``max_turns``. Each result's ``input`` is ``{"prompt": ...}``.
    """
    kwargs = _scatter_kwargs(prompts, backend, model, max_tokens, output_schema, batch_kwargs)
    return run_batch(**kwargs) if kwargs["inputs"] else []


async def ascatter_gather(
    prompts: Sequence[str],
    *,
    backend: str | Sequence[str] | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    output_schema: type[BaseModel] | None = None,
    **batch_kwargs: Any,
) -> list[AgentResult]:
    """Async ``scatter_gather``."""
    kwargs = _scatter_kwargs(prompts, backend, model, max_tokens, output_schema, batch_kwargs)
    return await arun_batch(**kwargs) if kwargs["inputs"] else []


async def abroadcast(
    prompt: str,
    *,
    backend: str | Sequence[str] | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    output_schema: type[BaseModel] | None = None,
    **batch_kwargs: Any,
) -> list[AgentResult]:
    """``prompt`` to every endpoint of the pool, one result per endpoint in pool order; each
    result's ``input`` is ``{"prompt": ..., "endpoint": url}``."""
    if not isinstance(prompt, str):
        raise BatchSpecError(f"broadcast: prompt must be a string, got {type(prompt).__name__}")
    urls = endpoint_urls(backend, who="broadcast")
    _check_extra("broadcast", batch_kwargs)
    if "batch_id" in batch_kwargs:
        raise BatchSpecError("broadcast: batch_id= does not apply: it runs one batch per "
                             "endpoint")

    async def one(i: int, url: str) -> AgentResult:
        [result] = await arun_batch(
            TASK, [{"prompt": prompt, "endpoint": url}], backend=url, model=model,
            max_tokens=max_tokens, output_schema=output_schema, max_turns=1, **batch_kwargs)
        return result.model_copy(update={"index": i})

    return list(await asyncio.gather(*(one(i, u) for i, u in enumerate(urls))))


def broadcast(
    prompt: str,
    *,
    backend: str | Sequence[str] | None = None,
    model: str | None = None,
    max_tokens: int | None = None,
    output_schema: type[BaseModel] | None = None,
    **batch_kwargs: Any,
) -> list[AgentResult]:
    """``abroadcast`` for synchronous code; inside an event loop await ``abroadcast``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(abroadcast(prompt, backend=backend, model=model,
                                      max_tokens=max_tokens, output_schema=output_schema,
                                      **batch_kwargs))
    raise RuntimeError("broadcast() was called inside a running event loop; "
                       "use 'await abroadcast(...)' there")

"""Batch prompting: many single-shot prompts in ONE ``POST /v1/completions``.

vLLM and SGLang accept ``prompt`` as a list and schedule the prompts together, which saves a
round trip and request overhead per prompt for single-turn work. The answer's ``choices`` carry
an ``index`` that is the only reliable link back to the prompt (servers may return them in
completion order), so we map by index and treat a reply missing any index as malformed.

The server reports ONE usage for the whole call. We split it across prompts proportionally
(prompt and cached tokens by prompt length, completion tokens by answer length, largest
remainder rounding) so per-agent numbers are plausible and the parts add up to the total
(cached tokens are clipped to a prompt's own share in the rare case rounding disagrees).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import BackendError, ServerError
from ..model_io import ModelResponse, Usage
from .openai_parse import parse_usage

log = logging.getLogger(__name__)

PostJson = Callable[[str, dict[str, Any], dict[str, str], float], Awaitable[Any]]


def completions_body(
    prompt: str | list[str],
    *,
    model: str,
    max_tokens: int | None,
    temperature: float | None,
    response_format: dict[str, Any] | None,
) -> dict[str, Any]:
    """The ``/v1/completions`` body; ``prompt`` is a string for one prompt, a list for many."""
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if response_format is not None:
        body["response_format"] = response_format
    return body


def shares(total: int, weights: list[int]) -> list[int]:
    """``total`` split by ``weights`` with largest-remainder rounding (even if all are 0)."""
    if not weights:
        return []
    if sum(weights) <= 0:
        weights = [1] * len(weights)
    denom = sum(weights)
    exact = [total * w / denom for w in weights]
    parts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def split_usage(total: Usage, prompts: list[str], texts: list[str]) -> list[Usage]:
    """One ``Usage`` per prompt whose fields sum to ``total`` (see the module docstring)."""
    by_prompt = [len(p) for p in prompts]
    prompt_tokens = shares(total.prompt_tokens, by_prompt)
    cached = shares(total.cached_tokens, by_prompt)
    completion = shares(total.completion_tokens, [len(t) for t in texts])
    return [
        Usage(prompt_tokens=p, cached_tokens=min(c, p), completion_tokens=o)
        for p, c, o in zip(prompt_tokens, cached, completion, strict=True)
    ]


def parse_completions(body: Any, prompts: list[str], *, who: str) -> list[ModelResponse]:
    """One ``ModelResponse`` per prompt, in prompt order; ``ServerError`` if any is missing."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list):
        raise ServerError(f"{who}: completions response has no choices", status=200)
    by_index: dict[int, dict[str, Any]] = {}
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", position if len(prompts) == 1 else None)
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(prompts):
            by_index.setdefault(index, choice)
    missing = [i for i in range(len(prompts)) if i not in by_index]
    if missing:
        raise ServerError(
            f"{who}: completions response lacks choices for prompt(s) {missing[:10]}",
            status=200,
        )
    texts = []
    for i in range(len(prompts)):
        text = by_index[i].get("text")
        texts.append(text if isinstance(text, str) else "")
    usages = split_usage(parse_usage(body), prompts, texts)
    out = []
    for i, text in enumerate(texts):
        reason = by_index[i].get("finish_reason")
        out.append(
            ModelResponse(
                text=text,
                usage=usages[i],
                finish_reason=reason if isinstance(reason, str) else None,
            )
        )
    return out


async def run_batch(
    post_json: PostJson,
    prompts: list[str],
    *,
    model: str,
    max_tokens: int | None,
    temperature: float | None,
    response_format: dict[str, Any] | None,
    request_id: str,
    timeout: float,
    who: str,
) -> list[ModelResponse | BackendError]:
    """One batched call; if it fails for any reason, one call per prompt (concurrently).

    Each slot holds its prompt's response or its ``BackendError``: one bad prompt never fails
    its siblings. Per-prompt fallbacks carry ``X-Request-Id: {request_id}:{i}``.
    """
    if not prompts:
        return []

    async def send(prompt: str | list[str], rid: str) -> list[ModelResponse]:
        body = completions_body(
            prompt,
            model=model,
            max_tokens=max_tokens,
            temperature=temperature,
            response_format=response_format,
        )
        headers = {"X-Request-Id": rid} if rid else {}
        reply = await post_json("/v1/completions", body, headers, timeout)
        return parse_completions(reply, prompt if isinstance(prompt, list) else [prompt], who=who)

    if len(prompts) > 1:
        try:
            return list(await send(list(prompts), request_id))
        except BackendError as exc:
            log.info(
                "%s: batched completion of %d prompts failed (%s); sending singly",
                who,
                len(prompts),
                exc.kind,
            )

    async def one(i: int, prompt: str) -> ModelResponse | BackendError:
        try:
            return (await send(prompt, f"{request_id}:{i}" if request_id else ""))[0]
        except BackendError as exc:
            return exc

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

"""Batch prompting: many single-shot prompts in ONE ``POST /v1/completions``.

vLLM and SGLang accept ``prompt`` as a list and schedule the prompts together, which saves a
round trip and request overhead per prompt for single-turn work. The answer's ``choices`` carry
an ``index`` that is the only reliable link back to the prompt (servers may return them in
completion order), so we map by index and treat a reply missing any index as malformed.

The server reports ONE usage for the whole call. We split it across prompts proportionally
(prompt and cached tokens by prompt length, completion tokens by answer length, largest
remainder rounding) so per-agent numbers are plausible and the parts add up to the total
(cached tokens are clipped to a prompt's own share in the rare case rounding disagrees).

The output schema travels in each batched body in the form the server reads on
``/v1/completions``: vLLM and SGLang take ``response_format``; llama.cpp ignores that field
there and takes a top-level ``json_schema`` (the driver passes it as ``extra_body``).
``ServerTemplate`` renders the prompts with the server's own chat template instead of a
hard-coded ChatML: llama.cpp's ``/apply-template``, vLLM's ``/tokenize`` + ``/detokenize``.
SGLang (and ``sim://``) keep ChatML: SGLang's tokenize endpoint takes text, not messages, so
its template cannot be had over HTTP.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from agentbatch.backends.microbatch import message_text
from agentbatch.backends.openai_parse import parse_usage
from agentbatch.core.errors import BackendError, ServerError
from agentbatch.core.model_io import Message, ModelResponse, Usage

log = logging.getLogger(__name__)

PostJson = Callable[[str, dict[str, Any], dict[str, str], float], Awaitable[Any]]
ApplyTemplate = Callable[[list[Message]], Awaitable[str]]


def completions_body(
    prompt: str | list[str],
    *,
    model: str,
    max_tokens: int | None,
    temperature: float | None,
    response_format: dict[str, Any] | None,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` body; ``prompt`` is a string for one prompt, a list for many.
    ``extra_body`` adds server-specific fields (llama.cpp's ``json_schema``)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if temperature is not None:
        body["temperature"] = temperature
    if response_format is not None:
        body["response_format"] = response_format
    if extra_body:
        body.update(extra_body)
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
    extra_body: dict[str, Any] | None = None,
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
            extra_body=extra_body,
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


def text_conversations(conversations: Sequence[list[Message]]) -> list[list[Message]]:
    """Each message as ``{role, content}`` with text content, the form template endpoints take:
    batched turns are text only (``microbatch.batchable``), and other keys would only vary
    the shapes ``ServerTemplate`` learns."""
    return [
        [{"role": m.get("role", "user"), "content": message_text(m.get("content")) or ""}
         for m in conversation]
        for conversation in conversations
    ]


# A content placeholder no real message carries: the template renders it where content goes.
_SLOT = "\u2063agentbatch-content-{}\u2063"


class ServerTemplate:
    """Conversations rendered with the server's chat template, one template call per shape.

    Asking the server for every prompt would cost a round trip each, which is what batching
    saves. So for each sequence of roles we render once with placeholder contents, keep the
    literal text between them, and fill in each conversation's own contents. A template that
    transforms content (trims, splits reasoning ...) would make that wrong, so the first real
    conversation of each shape is also rendered by the server and compared; on a mismatch
    that shape is rendered by the server per conversation. ``apply`` errors propagate.
    """

    def __init__(self, apply: ApplyTemplate) -> None:
        self._apply = apply
        self._shapes: dict[tuple[str, ...], asyncio.Future[list[str] | None]] = {}
        self.server_renders = 0  # template calls made (for tests and stats)

    async def _render(self, messages: list[Message]) -> str:
        self.server_renders += 1
        return await self._apply(messages)

    async def _learn(self, conversation: list[Message]) -> list[str] | None:
        """The literal pieces around each message's content, or None when they do not hold."""
        placeholders = [{**m, "content": _SLOT.format(i)} for i, m in enumerate(conversation)]
        shaped, real = await asyncio.gather(
            self._render(placeholders), self._render(conversation)
        )
        pieces: list[str] = []
        rest = shaped
        for i in range(len(conversation)):
            before, found, rest = rest.partition(_SLOT.format(i))
            if not found:
                return None
            pieces.append(before)
        pieces.append(rest)
        return pieces if fill(pieces, conversation) == real else None

    async def _pieces(self, conversation: list[Message]) -> list[str] | None:
        shape = tuple(str(m.get("role", "user")) for m in conversation)
        known = self._shapes.get(shape)
        if known is None:
            known = asyncio.get_running_loop().create_future()
            self._shapes[shape] = known
            try:
                known.set_result(await self._learn(conversation))
            except BaseException as exc:
                del self._shapes[shape]  # learn again next time
                known.set_exception(exc)
                known.exception()  # retrieved: other waiters re-raise it
                raise
        return await asyncio.shield(known)

    async def render(self, conversation: list[Message]) -> str:
        pieces = await self._pieces(conversation)
        return fill(pieces, conversation) if pieces is not None else await self._render(
            conversation
        )

    async def render_many(self, conversations: Sequence[list[Message]]) -> list[str]:
        return list(await asyncio.gather(*(self.render(c) for c in conversations)))


def fill(pieces: list[str], conversation: list[Message]) -> str:
    """The template's literal ``pieces`` interleaved with the conversation's contents."""
    out = [pieces[0]]
    for piece, message in zip(pieces[1:], conversation, strict=True):
        content = message.get("content")
        out.append(content if isinstance(content, str) else "")
        out.append(piece)
    return "".join(out)

"""Batch prompting across concurrent agents: many ``complete`` calls, one HTTP request.

Agents of a single-turn, tool-free batch each send their own chat request; a self-hosted
server would schedule them together anyway, but every request costs a round trip, a parse and
a slot in the server's HTTP front end. ``MicroBatchingBackend`` collects such calls for up to
``window_s`` (or until ``max_batch`` are queued), renders each conversation to one prompt
string and sends them as ONE ``complete_batch`` (``/v1/completions`` with a prompt list).
Every caller still gets its own ``ModelResponse`` or its own ``BackendError``: the inner
``complete_batch`` falls back to one call per prompt when the batched call fails.

Only text conversations without tool traffic can travel as a raw prompt (tool calls need the
server's chat template and parser), so requests with tools, tool messages or non-text content
pass straight to ``inner.complete``. Requests are grouped by (model, max_tokens, temperature,
json_schema): one ``/v1/completions`` body carries one value of each. A group that gathers a
single request by the end of its window is sent as a normal chat call, so a lone agent pays
only the window, never a worse prompt rendering.

The default renderer is ChatML (Qwen, many fine-tunes); pass ``render=`` for other models --
with a raw prompt the server does not apply the model's chat template for us. A driver that can
render with the server's own template (llama.cpp's ``/apply-template``, vLLM's ``/tokenize``)
gets the conversations too and uses that instead; ``sglang://`` and ``sim://`` keep ChatML.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.core.errors import BackendError, BackendTimeout, ServerError
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse, canonical_json
from agentbatch.core.wait_for import wait_for

log = logging.getLogger(__name__)

Render = Callable[[list[Message]], str]
GroupKey = tuple[str, int | None, float | None, str]

TEXT_ROLES = frozenset({"system", "developer", "user", "assistant"})


def message_text(content: Any) -> str | None:
    """``content`` as text, or None when it holds anything but text (images, audio ...)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text":
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        else:
            return None
    return "".join(texts)


def chatml(messages: list[Message]) -> str:
    """The ChatML template: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
    ``<|im_start|>assistant\\n`` to open the reply. ``developer`` is rendered as ``system``."""
    parts = []
    for msg in messages:
        role = msg.get("role", "user")
        role = "system" if role == "developer" else role
        parts.append(f"<|im_start|>{role}\n{message_text(msg.get('content')) or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def batchable(request: ModelRequest) -> bool:
    """True when ``request`` can travel as one raw prompt: text only, no tools, no tool turns."""
    if request.tools or not request.messages:
        return False
    for msg in request.messages:
        if msg.get("role") not in TEXT_ROLES or msg.get("tool_calls") or msg.get("tool_call_id"):
            return False
        if message_text(msg.get("content")) is None:
            return False
    return True


def group_key(request: ModelRequest) -> GroupKey:
    """Requests that may share one ``/v1/completions`` body have equal keys."""
    schema = canonical_json(request.json_schema) if request.json_schema else ""
    return (request.model, request.max_tokens, request.temperature, schema)


@dataclass
class _Pending:
    request: ModelRequest
    future: asyncio.Future[ModelResponse]


@dataclass
class _Group:
    items: list[_Pending] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class MicroBatchingBackend(BackendWrapper):
    """A ``Backend`` that turns concurrent tool-free ``complete`` calls into ``complete_batch``.

    ``enabled=None`` (default) batches only when the inner backend declares
    ``capabilities.batch_prompting`` (its promise to implement ``complete_batch``); otherwise
    every call passes through. Wear it *inside* ``RetryingBackend`` so a prompt whose own
    fallback call failed is retried (and joins a later batch). The other hooks (``warm``,
    ``fetch_load`` ...) are the inner's (``BackendWrapper``).
    """

    def __init__(
        self,
        inner: Backend,
        *,
        window_s: float = 0.01,
        max_batch: int = 32,
        render: Render = chatml,
        enabled: bool | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if window_s < 0:
            raise ValueError("window_s must be >= 0")
        super().__init__(inner)
        self.window_s = window_s
        self.max_batch = max_batch
        self.render = render
        if enabled is None:
            enabled = bool(inner.capabilities.batch_prompting)
        self.enabled = enabled
        self._groups: dict[GroupKey, _Group] = {}
        self._inflight: set[asyncio.Task[None]] = set()
        self.prompts = 0  # requests that entered a batching window
        self.batches = 0  # complete_batch calls (each >= 2 prompts)
        self.batched_prompts = 0  # prompts sent inside those calls
        self.solo = 0  # windows that closed with one request: sent as a chat call
        self.direct = 0  # requests that could not be batched (tools, images ...)

    @property
    def requests_sent(self) -> int:
        """HTTP requests the inner backend sent (fallbacks included) when it counts them;
        else the calls this layer made to it."""
        sent = self._inner.requests_sent
        return sent if isinstance(sent, int) else self.batches + self.solo + self.direct

    def stats(self) -> dict[str, int]:
        """Counters for reports; ``inner_calls`` = batches + solo + direct."""
        return {
            "prompts": self.prompts,
            "batches": self.batches,
            "batched_prompts": self.batched_prompts,
            "solo": self.solo,
            "direct": self.direct,
            "inner_calls": self.batches + self.solo + self.direct,
            "requests_sent": self.requests_sent,
        }

    # -- Backend protocol -------------------------------------------------------------------

    async def complete(self, request: ModelRequest) -> ModelResponse:
        if not self.enabled or not batchable(request):
            self.direct += 1
            return await self._inner.complete(request)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[ModelResponse] = loop.create_future()
        self._enqueue(group_key(request), _Pending(request, future))
        if request.timeout_s is None:
            return await future  # a cancelled caller cancels its future: skipped at flush
        try:
            return await wait_for(future, request.timeout_s)
        except asyncio.TimeoutError:
            raise BackendTimeout(
                f"{self.name}: no batched answer within {request.timeout_s:g}s"
            ) from None

    async def aclose(self) -> None:
        """Send whatever is still queued, wait for it, then close the inner backend."""
        for key in list(self._groups):
            self._flush(key)
        if self._inflight:
            await asyncio.gather(*self._inflight, return_exceptions=True)
        await self._inner.aclose()

    def __repr__(self) -> str:
        return f"MicroBatchingBackend({self._inner!r}, max_batch={self.max_batch})"

    # -- batching ---------------------------------------------------------------------------

    def _enqueue(self, key: GroupKey, item: _Pending) -> None:
        self.prompts += 1
        group = self._groups.setdefault(key, _Group())
        group.items.append(item)
        if len(group.items) >= self._batch_limit():
            self._flush(key)
        elif group.timer is None:
            loop = asyncio.get_running_loop()
            group.timer = loop.call_later(self.window_s, self._flush, key)

    def _batch_limit(self) -> int:
        """``max_batch``, or less when the server says how many prompts it runs at once
        (llama.cpp's slots): a bigger batch only queues there, and every prompt of a batch
        waits for its slowest wave, so a large one outlasts the turn's timeout."""
        hint = self._inner.batch_limit
        return min(self.max_batch, hint) if isinstance(hint, int) and hint > 0 else self.max_batch

    def _flush(self, key: GroupKey) -> None:
        group = self._groups.pop(key, None)
        if group is None:
            return
        if group.timer is not None:
            group.timer.cancel()
        items = [it for it in group.items if not it.future.done()]  # drop cancelled callers
        if not items:
            return
        if len(items) == 1:
            self.solo += 1
            coro = self._send_one(items[0])
        else:
            self.batches += 1
            self.batched_prompts += len(items)
            coro = self._send_many(items)
        task = asyncio.get_running_loop().create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _send_one(self, item: _Pending) -> None:
        try:
            response = await self._inner.complete(item.request)
        except BaseException as exc:
            _settle(item, exc)
            if not isinstance(exc, Exception):
                raise
            return
        _settle(item, response)

    async def _send_many(self, items: list[_Pending]) -> None:
        first = items[0].request
        try:
            results = await self._inner.complete_batch(
                [self.render(it.request.messages) for it in items],
                model=first.model,
                max_tokens=first.max_tokens,
                temperature=first.temperature,
                json_schema=first.json_schema,
                request_id=f"batch-{first.request_id}" if first.request_id else "",
                # The conversations too, for a driver that renders with the server's template
                # (llama.cpp, vLLM); only when no custom ``render`` was chosen.
                messages=[it.request.messages for it in items] if self.render is chatml else None,
            )
            if len(results) != len(items):
                raise ServerError(
                    f"{self.name}: complete_batch returned {len(results)} results "
                    f"for {len(items)} prompts"
                )
        except BaseException as exc:
            for it in items:
                _settle(it, exc)
            if not isinstance(exc, Exception):
                raise
            return
        for it, result in zip(items, results, strict=True):
            _settle(it, result)


def _settle(item: _Pending, outcome: ModelResponse | BaseException) -> None:
    """Hand ``outcome`` to the caller unless it has gone (cancelled or timed out)."""
    fut = item.future
    if fut.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        fut.cancel()
    elif isinstance(outcome, BaseException):
        if not isinstance(outcome, BackendError):
            log.error("batched completion raised %r", outcome)
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)

"""Make a turn's prompt fit the model's context before it is sent (both engines).

``turn_io.call_model`` calls ``fit_request`` on every turn. The context is
``max_context_tokens`` or what the server states (``Backend.context_length``); without
either nothing is checked. A prompt is sized by a bound that needs no IO first (every token is
at least a byte), and only when that bound does not clear the limit by the server's own
``/tokenize`` (``Backend.count_tokens``), else by an estimate; the usage says which.

Past ``compaction_threshold`` of the context, compaction builds a shorter VIEW of the
conversation (``compaction.py``): the stored history is not touched, the shared prefix stays
byte-identical. A prompt that still does not fit is never sent: the agent ends
``context_overflow`` with the sizes.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from agentbatch.backends.base import Backend
from agentbatch.core import compaction as cp
from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import Message, ModelRequest, Usage, agent_key
from agentbatch.core.turns import Abandoned
from agentbatch.turnloop.runtime import BatchRuntime

log = logging.getLogger(__name__)

Count = Literal["counted", "estimated"]
ROUNDS = 4  # truncation rounds, each cutting more, before the prompt is declared too long
SUMMARY_MAX_TOKENS = 1024
_SUMMARIES: OrderedDict[str, str] = OrderedDict()  # summary_key -> text, this process
_MAX_SUMMARIES = 256
# backend|system message+tools -> the server's token count of them, this process
_PREFIXES: OrderedDict[str, int] = OrderedDict()
_MAX_PREFIXES = 64
# batch:index -> where the agent's last summary ended, this process: a later turn keeps it
# while it fits, so its summary is reused (``compaction.summary_start``). A worker that did not
# make it summarizes once more, then reuses its own.
_STARTS: OrderedDict[str, int] = OrderedDict()


@dataclass
class Fitted:
    """The request to send, how its size was known, and the tokens compaction spent."""

    request: ModelRequest
    count: Count | None
    usage: Usage | None = None  # None: nothing spent (no Usage made on every turn)


@dataclass
class _Budget:
    context: int
    source: str  # where the context length came from, for the error message
    reserve: int  # tokens kept for the reply (max_tokens, at least one)
    target: int  # what compaction aims at (the threshold, or the hard limit)

    @property
    def hard(self) -> int:
        """The most prompt tokens a request may have."""
        return self.context - self.reserve


async def fit_request(rt: BatchRuntime, state: AgentState,
                      request: ModelRequest) -> Fitted | Abandoned:
    """``request`` as it may be sent, compacted if needed; ``Abandoned(context_overflow)``
    when it cannot fit. A summary whose model call fails falls back to truncation."""
    budget = await _budget(rt, request)
    if budget is None:
        return Fitted(request, None)
    quick = _quick_json_bytes(request.messages)
    if quick is not None and (quick + cp.MESSAGE_OVERHEAD_TOKENS * len(request.messages)
                              + _tools_bound(request.tools)) <= budget.target:
        # at least ``measure``'s bound, so that bound is within the target too: the very
        # outcome ``measure`` gives below, without the JSON text of the whole conversation
        return Fitted(request, "estimated")
    size, how = await measure(rt.backend, request.messages, request.tools, budget.target)
    if size <= budget.target:
        return Fitted(request, how)
    fitted = Fitted(request, how)
    if rt.plan.compaction is not None:
        fitted, size = await _compact(rt, state, request, budget, size, how)
    if size > budget.hard:
        return Abandoned("context_overflow", _overflow(rt, budget, size, fitted.count))
    return fitted


async def _budget(rt: BatchRuntime, request: ModelRequest) -> _Budget | None:
    plan = rt.plan
    context, source = plan.max_context_tokens, "max_context_tokens"
    if context is None:
        context, source = await rt.backend.context_length(), f"stated by {rt.backend.name}"
    if context is None:
        return None
    reserve = max(request.max_tokens or 1, 1)
    hard = context - reserve
    target = min(hard, int(plan.compaction_threshold * context)) if plan.compaction else hard
    return _Budget(context, source, reserve, target)


async def measure(backend: Backend, messages: list[Message], tools: list[dict[str, Any]],
                  limit: int) -> tuple[int, Count]:
    """The prompt's size: its byte bound when that is within ``limit`` (no IO), else the same
    bound with the shared prefix counted by the server once per process, else the server's
    count of the whole prompt, else an estimate."""
    bound = cp.token_upper_bound(messages) + _tools_bound(tools)  # = (messages, tools)
    if bound <= limit:
        return bound, "estimated"
    rest = await _bound_past_prefix(backend, messages, tools)
    if rest is not None and rest <= limit:
        return rest, "estimated"
    try:
        counted = await backend.count_tokens(messages, tools or None)
    except Exception:  # counting is advisory: a failure must not end the agent
        log.warning("%s: counting tokens failed; estimating", backend.name, exc_info=True)
        counted = None
    if counted is not None:
        return counted, "counted"
    return cp.estimate_tokens(messages, tools), "estimated"


_QUICK_DEPTH = 8  # deeper values are left to the exact count
_QUICK_PER_CHAR = 6  # the most JSON bytes an ASCII character becomes ("\\u001f")


def _quick_json_bytes(value: Any, depth: int = 0) -> int | None:
    """At least ``compaction._json_bytes(value)`` (the UTF-8 bytes of its compact JSON),
    without making that text; None when this cannot tell (then the caller counts exactly).

    An ASCII string is bounded by six bytes a character plus its quotes (JSON escapes a
    control character as ``\\u00XX``, a quote or backslash as two), containers by their
    brackets, separators and keys. Anything JSON might render otherwise (floats, non-ASCII
    text, non-string keys, other types, deep nesting) is left to the exact count. Loose by
    design: it only has to clear a limit far above the conversation, which is then encoded
    once, to be sent, instead of twice (issue 26 item 5)."""
    cls = value.__class__
    if cls is str:
        return _QUICK_PER_CHAR * len(value) + 2 if value.isascii() else None
    if cls is dict:
        if not value:
            return 2
        if depth >= _QUICK_DEPTH:
            return None
        size = 1 + len(value)  # the braces and the commas between items
        for key, item in value.items():
            if key.__class__ is not str or not key.isascii():
                return None
            if item.__class__ is str and item.isascii():  # inline: most values are text
                size += _QUICK_PER_CHAR * (len(key) + len(item)) + 5  # 2 quotes each, ':'
            elif item is None:
                size += _QUICK_PER_CHAR * len(key) + 7  # '"key":null'
            else:
                sub = _quick_json_bytes(item, depth + 1)
                if sub is None:
                    return None
                size += _QUICK_PER_CHAR * len(key) + 3 + sub
        return size
    if cls is list:
        if not value:
            return 2
        if depth >= _QUICK_DEPTH:
            return None
        size = 1 + len(value)  # the brackets and the commas between items
        for item in value:
            sub = _quick_json_bytes(item, depth + 1)
            if sub is None:
                return None
            size += sub
        return size
    if value is None or cls is bool:
        return 5  # null, true, false
    if cls is int:
        return len(int.__repr__(value))
    return None


_TOOLS_BOUND: tuple[list[dict[str, Any]] | None, int] = (None, 0)  # a copy of the last tools


def _tools_bound(tools: list[dict[str, Any]]) -> int:
    """The tools' part of ``cp.token_upper_bound(messages, tools)``. Every turn of a batch
    sends the same tools (the plan's ``tool_schemas``), so their size is remembered with a
    copy of them: comparing is a fraction of a ``json.dumps`` of them on every turn, and
    tools that differ in anything are sized anew (issue 26 item 5)."""
    global _TOOLS_BOUND
    if not tools:
        return 0
    last, bound = _TOOLS_BOUND
    if last != tools:
        bound = cp.token_upper_bound([], tools) - cp.token_upper_bound([])
        _TOOLS_BOUND = (copy.deepcopy(tools), bound)
    return bound


async def _bound_past_prefix(backend: Backend, messages: list[Message],
                             tools: list[dict[str, Any]]) -> int | None:
    """An upper bound with the system message and tools counted by the server (once per
    prefix and process: every agent of a batch shares them) and the rest bounded by its
    bytes. The byte bound alone counts a schema-heavy prefix several times over, which sent
    two extra requests (/apply-template, /tokenize) with nearly every llama.cpp turn."""
    if len(messages) < 2 or messages[0].get("role") != "system":
        return None
    head = messages[:1]
    key = f"{backend.name}|{cp.canonical_json([head, tools])}"
    counted = _PREFIXES.get(key)
    if counted is None:
        try:
            counted = await backend.count_tokens(head, tools or None)
        except Exception:  # counting is advisory: the caller counts the whole prompt
            log.debug("%s: counting the shared prefix failed", backend.name, exc_info=True)
            return None
        if counted is None:
            return None
        _PREFIXES[key] = counted
        while len(_PREFIXES) > _MAX_PREFIXES:
            _PREFIXES.popitem(last=False)
    else:
        _PREFIXES.move_to_end(key)
    return counted + cp.token_upper_bound(messages[1:])


async def _compact(rt: BatchRuntime, state: AgentState, request: ModelRequest, budget: _Budget,
                   size: int, how: Count) -> tuple[Fitted, int]:
    prefix, convo = request.messages[:1], request.messages[1:]
    usage = Usage()
    if rt.plan.compaction == "summarize":
        summarized = await _summarized(rt, state, request, budget, size)
        if summarized is not None:
            convo, usage = summarized
            size, how = await measure(rt.backend, [*prefix, *convo], request.tools,
                                      budget.target)
    view = convo
    for round_ in range(ROUNDS):
        if size <= budget.target:
            break
        chars = cp.prompt_chars([*prefix, *convo], request.tools)
        excess = size - budget.target
        cut = cp.chars_for_tokens(excess, size, chars) * (round_ + 1)
        view, removed = cp.truncate_tool_outputs(convo, cut)
        if not removed:
            break
        size, how = await measure(rt.backend, [*prefix, *view], request.tools, budget.target)
    fitted = request.model_copy(update={"messages": [*prefix, *view]})
    return Fitted(fitted, how, usage), size


async def _summarized(rt: BatchRuntime, state: AgentState, request: ModelRequest,
                      budget: _Budget, size: int) -> tuple[list[Message], Usage] | None:
    """The conversation with its older turns replaced by a summary, and the summary's
    usage; None when nothing can be summarized (then truncation alone applies)."""
    prefix, convo = request.messages[:1], request.messages[1:]
    points = cp.summary_points(convo)
    if not points:
        return None
    chars = cp.prompt_chars(request.messages, request.tools)
    room = budget.target - min(SUMMARY_MAX_TOKENS, budget.target // 4)

    def tail_tokens(point: int) -> float:  # the kept tail's estimate, at the prompt's density
        kept = cp.prompt_chars([*prefix, convo[0], *convo[point:]], request.tools)
        return size * kept / chars

    agent = agent_key(rt.plan.batch_id, state.index)
    start = cp.summary_start(points, tail_tokens, room, tail_tokens(len(convo)),
                             _STARTS.get(agent))
    _remember(_STARTS, agent, start)
    older = convo[1:start]
    key = cp.summary_key(rt.plan.model, older)
    usage = Usage()
    summary = _SUMMARIES.get(key)
    if summary is None:
        summary, usage = await _summarize(rt, state, older, budget)
        if summary is None:
            return None
        _remember(_SUMMARIES, key, summary)
    return cp.summary_view(convo, start, summary), usage


def _remember(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    """Put ``key`` in a bounded per-process cache (the oldest entry goes first)."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _MAX_SUMMARIES:
        cache.popitem(last=False)


async def _summarize(rt: BatchRuntime, state: AgentState, older: list[Message],
                     budget: _Budget) -> tuple[str | None, Usage]:
    """One model call that summarizes ``older`` (its tool outputs cut first if the call
    itself would not fit)."""
    max_tokens = min(SUMMARY_MAX_TOKENS, max(budget.context // 4, 16))
    room = budget.context - max_tokens
    messages = cp.summary_request_messages(older)
    cut = 0
    for round_ in range(ROUNDS):  # the summary call must fit the context too
        needed, _ = await measure(rt.backend, messages, [], room)
        if needed <= room:
            break
        cut += cp.chars_for_tokens(needed - room, needed, cp.prompt_chars(messages)) * (round_ + 1)
        messages = cp.summary_request_messages(cp.truncate_tool_outputs(older, cut, head=0)[0])
    else:
        return None, Usage()
    plan = rt.plan
    request = ModelRequest(
        model=plan.model, messages=messages, max_tokens=max_tokens,
        temperature=plan.temperature,
        request_id=f"{plan.batch_id}-{state.index}-v{state.version}-summary",
        agent_key=agent_key(plan.batch_id, state.index), cached_on=state.endpoint,
        timeout_s=plan.timeout_per_turn,
    )
    try:
        response = await rt.backend.complete(request)
    except BackendError as exc:
        log.warning("agent %s: the summary call failed (%s); truncating instead",
                    state.index, exc)
        return None, Usage()
    text = (response.text or "").strip()
    return (text or None), response.usage


def _overflow(rt: BatchRuntime, budget: _Budget, size: int, count: Count | None) -> str:
    compaction = rt.plan.compaction
    why = ("compaction is off (compaction=None)" if compaction is None else
           f"compaction={compaction!r} could not make it fit")
    return (f"the next turn's prompt is {size} tokens ({count or 'estimated'}) and the reply "
            f"needs {budget.reserve} (max_tokens): {size + budget.reserve} > the context of "
            f"{budget.context} tokens ({budget.source}); {why}. It was not sent.")

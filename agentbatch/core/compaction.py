"""Compaction as a view: pure functions from an agent's conversation to a shorter one.

The stored conversation (``AgentState.messages``) is never rewritten: these functions build
the prompt of one turn from it (``context_fit.fit_request``), so the distributed engine's
history stays append-only and linear, and the same history always gives the same view.

Two rules hold for every view:
- the shared prefix (system message + tool schemas) is not touched, so its bytes are the same
  in every agent's request and the server's prefix cache keeps serving them;
- every assistant tool call keeps its tool result, in order (the OpenAI and Anthropic APIs
  refuse a result without its call, and a call without its result).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, get_args

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import Message, canonical_json
from agentbatch.core.options import Compaction

# What a cut tool output keeps at least of its start while older outputs can still be cut.
HEAD_CHARS = 200
CUT_MARKER = ("\n[agentbatch removed {removed} of {total} chars of this tool output (all "
              "after the first {kept}) to fit the model's context]")
SUMMARY_HEADER = ("\n\n[agentbatch replaced the {n} messages after this one with this summary "
                  "to fit the model's context]\n")
SUMMARY_SYSTEM = (
    "You summarize the earlier part of an agent's work so it can continue without it. Keep "
    "every fact, tool result, number, name and decision the agent may still need; drop "
    "repetition. Reply with the summary only."
)
# Chat templates add a few tokens per message (role markers), and tool schemas come with
# instructions; the bound below must stay above any tokenizer's count.
MESSAGE_OVERHEAD_TOKENS = 16
TOOLS_OVERHEAD_TOKENS = 256
CHARS_PER_TOKEN = 4
# A new summary leaves the kept tail at most this fraction of the room, so later turns reuse it.
SUMMARY_REFILL = 0.5


def check_compaction(compaction: object, threshold: object) -> None:
    """Refuse an unknown ``compaction`` or a ``compaction_threshold`` outside (0, 1]."""
    allowed = get_args(Compaction)
    if compaction is not None and compaction not in allowed:
        raise BatchSpecError(f"compaction must be one of {', '.join(map(repr, allowed))} or "
                             f"None, got {compaction!r}")
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) \
            or not math.isfinite(threshold) or not 0 < threshold <= 1:
        raise BatchSpecError(f"compaction_threshold must be a number in (0, 1], got "
                             f"{threshold!r}")


# -- sizes -------------------------------------------------------------------------------


def prompt_chars(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
    """Characters of the request's JSON: what the estimates are made from."""
    return len(canonical_json(messages)) + (len(canonical_json(tools)) if tools else 0)


def estimate_tokens(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
    """A token estimate for a server that cannot count: a token per 4 chars, plus overhead."""
    return (math.ceil(prompt_chars(messages, tools) / CHARS_PER_TOKEN)
            + MESSAGE_OVERHEAD_TOKENS * len(messages) + (TOOLS_OVERHEAD_TOKENS if tools else 0))


def token_upper_bound(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
    """More tokens than any byte-level tokenizer makes of this prompt: every token is at least
    one UTF-8 byte. A prompt under the limit by this bound needs no count from the server."""
    size = _json_bytes(messages) + (_json_bytes(tools) + TOOLS_OVERHEAD_TOKENS if tools else 0)
    return size + MESSAGE_OVERHEAD_TOKENS * len(messages)


def _json_bytes(value: Any) -> int:
    """UTF-8 bytes of ``canonical_json(value)``, made on every turn: key order does not change
    the length, so the keys are not sorted, and ASCII text (nearly all) is not encoded."""
    text = _COMPACT.encode(value)
    return len(text) if text.isascii() else len(text.encode())


# ``json.dumps(value, separators=(",", ":"), ensure_ascii=False)``'s encoder, made once
# (``dumps`` builds a new one on each call that passes any argument: issue 26 item 5).
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def chars_for_tokens(tokens: int, prompt_tokens: int, chars: int) -> int:
    """How many chars hold ``tokens`` tokens, at the density measured over the whole prompt
    (rounded up: cutting a little more is safe, cutting less is another round)."""
    per_token = chars / max(prompt_tokens, 1)
    return math.ceil(tokens * per_token)


# -- truncate ----------------------------------------------------------------------------


def cut_output(text: str, keep: int) -> str:
    """``text`` cut to its first ``keep`` chars plus a marker saying what was removed."""
    if keep >= len(text):
        return text
    keep = max(keep, 0)
    return text[:keep] + CUT_MARKER.format(removed=len(text) - keep, total=len(text), kept=keep)


def truncate_tool_outputs(messages: list[Message], cut_chars: int,
                          head: int = HEAD_CHARS) -> tuple[list[Message], int]:
    """``messages`` with tool outputs cut, oldest first, until ``cut_chars`` chars are gone.

    First each output is cut down to ``head`` chars (so every result keeps its start), the
    latest too when the older ones are not enough; then, if still short, to nothing but the
    marker. Only a tool message's string content changes: roles, ids and order stay, so each
    tool call keeps its result. Returns the view and the chars actually removed (counting the
    markers added), which is less than asked when nothing more can go.
    """
    view = [dict(m) for m in messages]
    removed = 0
    for floor in (head, 0):
        for msg in view:
            if removed >= cut_chars:
                return view, removed
            content = msg.get("content")
            if msg.get("role") != "tool" or not isinstance(content, str):
                continue
            need = cut_chars - removed
            keep = max(floor, len(content) - need - len(CUT_MARKER) - 24)
            cut = cut_output(content, keep)
            if len(cut) < len(content):
                removed += len(content) - len(cut)
                msg["content"] = cut
    return view, removed


# -- summarize ---------------------------------------------------------------------------


def summary_points(messages: list[Message]) -> list[int]:
    """Where the kept tail may start, most kept first: an assistant message with at least
    one message between it and the task. Everything before it is summarized, so no tool
    result is ever separated from its call."""
    return [i for i in range(len(messages) - 1, 1, -1)
            if messages[i].get("role") == "assistant"][::-1]


def summary_start(points: list[int], tail_tokens: Callable[[int], float], room: float,
                  fixed: float = 0, previous: int | None = None) -> int:
    """Where this turn's kept tail starts (``points`` from ``summary_points``, non-empty).

    ``tail_tokens(p)``: the prompt's size keeping ``messages[p:]``, of which ``fixed`` is
    always there (system, tools, task). ``previous`` (the start of this agent's last summary)
    is kept while its tail still fits ``room``: the summarized part is then the same, so is
    its summary (cached, no model call). A new start keeps the most tail that fills at most
    ``SUMMARY_REFILL`` of the room left after ``fixed``, so the next turns' growth fits under
    the same summary; without that margin the start moved, and a summary was made, on every
    turn past the threshold. The last point when no tail fits.
    """
    if previous in points and tail_tokens(previous) <= room:
        return previous
    refill = fixed + (room - fixed) * SUMMARY_REFILL
    return next((p for p in points if tail_tokens(p) <= refill), points[-1])


def summary_view(messages: list[Message], start: int, summary: str) -> list[Message]:
    """The task, the summary of ``messages[1:start]``, then ``messages[start:]`` unchanged.

    The summary is appended to the task message (a user turn), so the roles still alternate
    user, assistant, ... as every chat template expects.
    """
    task = dict(messages[0])
    note = SUMMARY_HEADER.format(n=start - 1) + summary.strip()
    if isinstance(task.get("content"), str):
        task["content"] = task["content"] + note
        return [task, *messages[start:]]
    return [task, {"role": "user", "content": note.lstrip()}, *messages[start:]]


def transcript(messages: list[Message]) -> str:
    """The messages as plain text for the summarizer (no tool-call structure to keep)."""
    lines = []
    names: dict[str, str] = {}  # tool_call_id -> the tool's name (a tool message has none)
    for m in messages:
        role = m.get("role", "user")
        content = m.get("content")
        text = content if isinstance(content, str) else canonical_json(content or "")
        if role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "", "")
            lines.append(f"[tool result {name}]\n{text}" if name else f"[tool result]\n{text}")
            continue
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            names[call.get("id") or ""] = str(fn.get("name") or "")
            text += f"\n[called {fn.get('name')}({fn.get('arguments')})]"
        lines.append(f"[{role}]\n{text.strip()}")
    return "\n\n".join(lines)


def summary_request_messages(older: list[Message]) -> list[Message]:
    """The summarizer's conversation for ``older`` messages."""
    return [{"role": "system", "content": SUMMARY_SYSTEM},
            {"role": "user", "content": "Summarize this:\n\n" + transcript(older)}]


def summary_key(model: str, older: list[Message]) -> str:
    """Names a summary of ``older`` so the same history is summarized once per process."""
    return hashlib.sha256(f"{model}\n{canonical_json(older)}".encode()).hexdigest()

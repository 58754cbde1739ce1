"""The scripted model: ``@sim`` directives in user messages decide every turn (pure: no IO).

A test writes its agent's whole behaviour into the task text, so the simulator needs no
per-test setup and the same conversation always produces the same turns, over any client.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agentbatch.core.model_io import Message, canonical_json

PREFIX = "@sim"
_NAME = re.compile(r"\s*([A-Za-z0-9_.:\-]+)\s*")
_FAIL_OPT = re.compile(r"^(times|retry_after)=(\S+)$")
_ANSWER = re.compile(r"\s*@sim\s+answer(?: (.*))?$", re.DOTALL)
_DECODER = json.JSONDecoder()
# agentbatch's summary transcript (``core.compaction.transcript``): a call, a result.
_CALLED = re.compile(r"^\[called ([A-Za-z0-9_.:\-]+)\((.*)\)\]$")
_RESULT = "[tool result"


@dataclass(frozen=True)
class ToolCallSpec:
    """One scripted tool call: a name and its JSON-object arguments."""

    name: str
    arguments: dict[str, Any]

    @property
    def args_json(self) -> str:
        return canonical_json(self.arguments)


@dataclass(frozen=True)
class FailSpec:
    """``@sim fail KIND [times=N] [retry_after=S]``; ``ordinal`` identifies the directive."""

    kind: str
    times: int = 1
    retry_after: str = "0"
    ordinal: int = 0


@dataclass
class Script:
    """All directives found in a request's user text, in order."""

    rounds: list[list[ToolCallSpec]] = field(default_factory=list)
    answer: str | None = None
    tokens: int | None = None
    fails: list[FailSpec] = field(default_factory=list)
    # ``@sim same_ids``: every call of a round carries the first call's id, as a buggy
    # server's tool parser can do (clients must still match each result to its call).
    same_ids: bool = False
    # ``@sim done NAME {args}``: a call answered in a part of the conversation that a summary
    # replaced (the simulator's summaries say so), counted as answered like a tool message.
    done: list[ToolCallSpec] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # unparseable directive lines (ignored)


@dataclass(frozen=True)
class EmittedCall:
    """A tool call as sent on the wire; ``arguments`` may be invalid JSON (fault injection)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """What the model says this turn, before token accounting and wire shaping."""

    content: str | None
    tool_calls: list[EmittedCall] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def cost_text(self) -> str:
        """The text whose length stands for the generated tokens."""
        calls = "".join(c.name + c.arguments for c in self.tool_calls)
        return (self.content or "") + calls


def sha1_hex(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def content_text(content: Any) -> str:
    """The text of a message content: a string, or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def user_texts(messages: list[Message]) -> list[str]:
    return [content_text(m.get("content")) for m in messages if m.get("role") == "user"]


def agent_key(messages: list[Message]) -> str:
    """sha1 of the first user message: stable for every turn of one agent."""
    texts = user_texts(messages)
    return sha1_hex(texts[0] if texts else "")


def tool_call_id(key: str, name: str, args_json: str, occurrence: int = 0) -> str:
    suffix = f"#{occurrence}" if occurrence else ""
    return "call_" + sha1_hex(key + name + args_json + suffix)[:8]


def _parse_call(text: str, pos: int) -> tuple[ToolCallSpec, int]:
    """Parse ``NAME [{json}]`` starting at ``pos``; returns the call and the end position."""
    m = _NAME.match(text, pos)
    if not m:
        raise ValueError("expected a tool name")
    pos = m.end()
    args: Any = {}
    if pos < len(text) and text[pos] == "{":
        args, pos = _DECODER.raw_decode(text, pos)
    if not isinstance(args, dict):
        raise ValueError("tool arguments must be a JSON object")
    return ToolCallSpec(m.group(1), args), pos


def _parse_calls(text: str, many: bool) -> list[ToolCallSpec]:
    calls: list[ToolCallSpec] = []
    pos = 0
    while True:
        call, pos = _parse_call(text, pos)
        calls.append(call)
        rest = text[pos:].lstrip()
        if not rest:
            return calls
        if not many or not rest.startswith(";"):
            raise ValueError(f"unexpected text after tool call: {rest[:30]!r}")
        pos = len(text) - len(rest) + 1


def _parse_fail(rest: str, ordinal: int) -> FailSpec:
    from agentbatch.sim.faults import FAULT_KINDS  # local: faults imports this module

    words = rest.split()
    if not words or words[0] not in FAULT_KINDS:
        raise ValueError(f"fail kind must be one of {FAULT_KINDS}")
    times, retry_after = 1, "0"
    for word in words[1:]:
        m = _FAIL_OPT.match(word)
        if not m:
            raise ValueError(f"bad fail option {word!r}")
        if m.group(1) == "times":
            times = int(m.group(2))
        else:
            float(m.group(2))  # validate; keep the caller's spelling for the header
            retry_after = m.group(2)
    return FailSpec(words[0], times, retry_after, ordinal)


def parse_script(texts: Iterable[str]) -> Script:
    """Collect directives from every line of every text, in order."""
    script = Script()
    for text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if not line.startswith(PREFIX + " "):
                continue
            verb, _, rest = line[len(PREFIX) + 1 :].strip().partition(" ")
            try:
                if verb in ("tool", "tools"):
                    script.rounds.append(_parse_calls(rest, many=verb == "tools"))
                elif verb == "answer":
                    # Everything after "@sim answer " verbatim; "\n" escapes become newlines.
                    m = _ANSWER.match(raw)
                    script.answer = ((m and m.group(1)) or "").replace("\\n", "\n")
                elif verb == "tokens":
                    script.tokens = max(1, int(rest.strip()))
                elif verb == "fail":
                    script.fails.append(_parse_fail(rest, len(script.fails)))
                elif verb == "same_ids":
                    script.same_ids = True
                elif verb == "done":
                    script.done.extend(_parse_calls(rest, many=False))
                else:
                    raise ValueError(f"unknown directive {verb!r}")
            except ValueError as exc:
                script.errors.append(f"{line[:80]}: {exc}")
    return script


def _call_key(function: dict[str, Any]) -> tuple[str, str]:
    name = str(function.get("name", ""))
    args = function.get("arguments", "")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return name, args  # unparseable: can never match a scripted call
    return name, canonical_json(args)


def answered_calls(messages: list[Message]) -> Counter[tuple[str, str]]:
    """(name, canonical args) of assistant tool calls that a later tool message answered."""
    pending: dict[str, tuple[str, str]] = {}
    answered: Counter[tuple[str, str]] = Counter()
    for msg in messages:
        role = msg.get("role")
        if role == "assistant":
            for call in msg.get("tool_calls") or []:
                if isinstance(call, dict) and call.get("id"):
                    pending[call["id"]] = _call_key(call.get("function") or {})
        elif role == "tool":
            key = pending.pop(msg.get("tool_call_id") or "", None)
            if key is not None:
                answered[key] += 1
    return answered


def done_calls(script: Script) -> Counter[tuple[str, str]]:
    """(name, canonical args) of the calls a summary in the conversation says were answered."""
    return Counter((call.name, call.args_json) for call in script.done)


def summary_reply(transcript: str, answered: Counter[tuple[str, str]]) -> str | None:
    """The simulator's summary of an agentbatch summary request: one ``@sim done`` line per
    tool call the transcript shows answered (``[called NAME(ARGS)]`` lines, each paired in
    order with a later ``[tool result`` line, plus ``answered``: json-mode result lines), so
    the script, reading the summary in the next turn's task message, does not call them
    again. None when the text shows no answered call (not a summary request)."""
    calls: list[tuple[str, str]] = []
    done: Counter[tuple[str, str]] = Counter(answered)
    for line in transcript.splitlines():
        called = _CALLED.match(line)
        if called:
            calls.append(_call_key({"name": called.group(1), "arguments": called.group(2)}))
        elif line.startswith(_RESULT) and calls:
            done[calls.pop(0)] += 1
    if not done:
        return None
    lines = [f"{PREFIX} done {name} {args}" for (name, args), n in sorted(done.items())
             for _ in range(n)]
    return "Tool calls already made, with their results:\n" + "\n".join(lines)


def pending_round(script: Script, answered: Counter[tuple[str, str]]) -> list[ToolCallSpec]:
    """The unanswered calls of the first scripted round that is not fully answered."""
    left = Counter(answered)
    for round_ in script.rounds:
        todo = []
        for call in round_:
            key = (call.name, call.args_json)
            if left[key] > 0:
                left[key] -= 1
            else:
                todo.append(call)
        if todo:
            return todo
    return []


def emit_calls(
    key: str, calls: list[ToolCallSpec], answered: Counter[tuple[str, str]],
    same_ids: bool = False,
) -> list[EmittedCall]:
    """Wire calls with deterministic ids; repeats of one call get distinct ids, unless
    ``same_ids`` gives the whole round the first call's id."""
    seen = Counter(answered)
    out: list[EmittedCall] = []
    for call in calls:
        k = (call.name, call.args_json)
        call_id = out[0].id if same_ids and out else tool_call_id(key, *k, seen[k])
        out.append(EmittedCall(call_id, call.name, call.args_json))
        seen[k] += 1
    return out

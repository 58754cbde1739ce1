"""The scripted model's decision for one request: tool calls or which answer (pure: no IO)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from agentbatch.core.model_io import Message
from agentbatch.sim.json_turns import answered_in_text, plan_json_turn, turn_forms
from agentbatch.sim.schema_fill import fill_schema
from agentbatch.sim.script import (
    Reply,
    Script,
    ToolCallSpec,
    answered_calls,
    content_text,
    done_calls,
    emit_calls,
    parse_script,
    pending_round,
    sha1_hex,
    summary_reply,
    user_texts,
)

_FENCED_JSON = re.compile(r"```json[ \t]*\r?\n(.*?)```", re.DOTALL)


@dataclass
class ChatPlan:
    """Everything decided about a chat request before faults and timing are applied."""

    agent_key: str
    script: Script
    reply: Reply
    pending: list[ToolCallSpec] = field(default_factory=list)  # unanswered scripted calls


@dataclass
class CompletionPlan:
    """The decision for one prompt of a ``/v1/completions`` request."""

    agent_key: str
    script: Script
    text: str


def request_schema(body: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """(schema, wants_json) from ``response_format`` or vLLM's ``guided_json``."""
    guided = body.get("guided_json")
    if isinstance(guided, str):
        try:
            guided = json.loads(guided)
        except ValueError:
            guided = None
    if isinstance(guided, dict):
        return guided, True
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt.get("type") == "json_schema":
            spec = fmt.get("json_schema") or {}
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if isinstance(schema, dict):
                return schema, True
            return None, True
        if fmt.get("type") == "json_object":
            return None, True
    return None, False


def fenced_schema(text: str) -> dict[str, Any] | None:
    """The LAST fenced ```json block in ``text`` that parses as a JSON object."""
    for block in reversed(_FENCED_JSON.findall(text)):
        try:
            value = json.loads(block)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def final_answer(script: Script, key: str, body: dict[str, Any], schema_text: str) -> str:
    """``@sim answer`` wins, then a requested schema, then a schema in the prompt, then text."""
    if script.answer is not None:
        return script.answer
    schema, wants_json = request_schema(body)
    if schema is None:
        schema = fenced_schema(schema_text)
    if schema is not None:
        return json.dumps(fill_schema(schema, key), ensure_ascii=False)
    text = f"sim answer {key[:8]}"
    return json.dumps({"answer": text}) if wants_json else text


def tools_allowed(body: dict[str, Any]) -> bool:
    return bool(body.get("tools")) and body.get("tool_choice") != "none"


def forced_call(tool: dict[str, Any], key: str) -> ToolCallSpec:
    """A call of ``tool`` with arguments filled from its schema (``tool_choice="required"``
    with no scripted call left)."""
    fn = tool.get("function") or tool
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    args = fill_schema(params, key)
    return ToolCallSpec(name=str(fn.get("name")), arguments=args if isinstance(args, dict)
                        else {})


def plan_chat(body: dict[str, Any]) -> ChatPlan:
    """Decide this turn of a chat request from its directives and its history."""
    messages: list[Message] = body.get("messages") or []
    texts = user_texts(messages)
    key = sha1_hex(texts[0] if texts else "")
    script = parse_script(texts)
    forms = None if tools_allowed(body) else turn_forms(request_schema(body)[0])
    if forms is not None:  # tool_calling="json": calls and results travel as text
        text, pending = plan_json_turn(forms, script, key, messages)
        return ChatPlan(key, script, Reply(text), pending)
    if not tools_allowed(body) and not request_schema(body)[1]:
        summary = summary_reply("\n".join(texts), answered_in_text(messages))
        if summary is not None:  # agentbatch's compaction asking for a summary
            return ChatPlan(key, script, Reply(summary))
    answered = answered_calls(messages) + done_calls(script)
    pending = pending_round(script, answered)
    if not pending and body.get("tool_choice") == "required" and tools_allowed(body):
        pending = [forced_call(body["tools"][0], key)]  # as vLLM's guided "required" would
    if pending and tools_allowed(body):
        calls = emit_calls(key, pending, answered, same_ids=script.same_ids)
        return ChatPlan(key, script, Reply(None, calls, "tool_calls"), pending)
    system = "\n".join(
        content_text(m.get("content")) for m in messages if m.get("role") in ("system", "developer")
    )
    return ChatPlan(key, script, Reply(final_answer(script, key, body, system)), pending)


def plan_completion(prompt: str, body: dict[str, Any]) -> CompletionPlan:
    """Decide the answer to one raw prompt (the prompt is both the task and the system text)."""
    key = sha1_hex(prompt)
    script = parse_script([prompt])
    return CompletionPlan(key, script, final_answer(script, key, body, prompt))


def completion_cost(script: Script, text: str, max_tokens: Any = None) -> int:
    """Completion tokens this answer costs: ``@sim tokens`` or ``len // 4 + 1``, capped."""
    cost = script.tokens if script.tokens is not None else len(text) // 4 + 1
    if isinstance(max_tokens, int) and max_tokens > 0:
        cost = min(cost, max_tokens)
    return max(1, cost)

"""Json-mode turns: the scripted model answering through agentbatch's turn schema (pure: no IO).

With ``tool_calling="json"`` a request carries no native tools. Its guided-JSON schema is a
union of ``{"tool_calls": [{"name", "arguments"}, ...]}`` and ``{"final": ...}`` (only the
calls form when a call is required, only the final form on a repair turn), earlier calls come
back as the assistant's JSON reply and their results as user-message lines
``{"arguments": ..., "name": ..., "result": ...}``. Filling the union blindly would call a tool
on every turn; this module follows the ``@sim tool`` script through that format instead, as
``model.plan_chat`` does through native tools.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from agentbatch.core.model_io import Message, canonical_json
from agentbatch.sim.schema_fill import fill_schema
from agentbatch.sim.script import Script, ToolCallSpec, content_text, done_calls, pending_round


@dataclass(frozen=True)
class TurnForms:
    """What a json-mode turn's schema allows: its calls form and/or its final form."""

    calls: dict[str, Any] | None  # the schema of one call (``tool_calls`` items)
    final: dict[str, Any] | None  # the schema of the ``final`` value
    defs: dict[str, Any] = field(default_factory=dict)  # the root's ``$defs``

    def fill(self, schema: dict[str, Any], key: str) -> Any:
        """A value of ``schema`` (a part of the root, whose ``$refs`` point at its defs)."""
        return fill_schema({**schema, "$defs": self.defs} if self.defs else schema, key)


def _object_with(variant: Any, name: str, *, only: bool = False) -> dict[str, Any] | None:
    """The schema of property ``name`` when ``variant`` is an object schema requiring it
    (``only``: and no other property, so a user's own schema with a ``final`` field is not
    taken for a json-mode turn)."""
    if not isinstance(variant, dict):
        return None
    props = variant.get("properties")
    if not isinstance(props, dict) or name not in props or name not in (variant.get("required")
                                                                        or ()):
        return None
    if only and set(props) != {name}:
        return None
    value = props[name]
    return value if isinstance(value, dict) else None


def turn_forms(schema: dict[str, Any] | None) -> TurnForms | None:
    """The forms of an agentbatch json-mode schema, or None for any other schema."""
    if not isinstance(schema, dict):
        return None
    any_of = schema.get("anyOf")
    variants = any_of if isinstance(any_of, list) else [schema]
    calls = final = None
    for variant in variants:
        array = _object_with(variant, "tool_calls", only=True)
        if array is not None and isinstance(array.get("items"), dict):
            calls = array["items"]
        value = _object_with(variant, "final", only=True)
        if value is not None:
            final = value
    if calls is None and final is None:
        return None
    found = schema.get("$defs")
    defs = found if isinstance(found, dict) else {}
    return TurnForms(calls, final, defs)


def answered_in_text(messages: list[Message]) -> Counter[tuple[str, str]]:
    """(name, canonical args) of the calls whose results came back as user-message lines."""
    answered: Counter[tuple[str, str]] = Counter()
    for msg in messages:
        if msg.get("role") != "user":
            continue
        for line in content_text(msg.get("content")).splitlines():
            if not line.startswith("{"):
                continue
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if isinstance(item, dict) and "result" in item and isinstance(item.get("name"), str):
                answered[(item["name"], canonical_json(item.get("arguments") or {}))] += 1
    return answered


def _first_call(forms: TurnForms, key: str) -> ToolCallSpec | None:
    """A call of the schema's first tool, its arguments filled (a required call, unscripted)."""
    assert forms.calls is not None
    options = forms.calls.get("anyOf") if isinstance(forms.calls.get("anyOf"), list) \
        else [forms.calls]
    first = options[0] if options else None
    name = (_object_with(first, "name") or {}).get("const")
    params = _object_with(first, "arguments") or {"type": "object"}
    if not isinstance(name, str):
        return None
    args = forms.fill(params, key)
    return ToolCallSpec(name, args if isinstance(args, dict) else {})


def _final_value(forms: TurnForms, script: Script, key: str) -> Any:
    """``@sim answer`` (as JSON when it parses and the answer is not a string), else a fill."""
    assert forms.final is not None
    if script.answer is not None:
        if forms.final.get("type") == "string":
            return script.answer
        try:
            return json.loads(script.answer)
        except ValueError:
            return script.answer
    return forms.fill(forms.final, key)


def plan_json_turn(forms: TurnForms, script: Script, key: str,
                   messages: list[Message]) -> tuple[str, list[ToolCallSpec]]:
    """(the reply's JSON text, the scripted calls still unanswered) for one json-mode turn.

    The script's next round is called while the schema allows calls; a turn that must call
    (no final form) and has no scripted call left calls the first tool, as a guided decoder
    would; otherwise the final answer."""
    pending = pending_round(script, answered_in_text(messages) + done_calls(script))
    calls = pending if forms.calls is not None else []
    if not calls and forms.final is None:
        forced = _first_call(forms, key)
        calls = [forced] if forced is not None else []
    if calls:
        body = {"tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
        return json.dumps(body, ensure_ascii=False), pending
    if forms.final is None:  # a calls-only schema naming no tool: nothing valid to say
        return json.dumps({"tool_calls": []}), pending
    return json.dumps({"final": _final_value(forms, script, key)}, ensure_ascii=False), pending

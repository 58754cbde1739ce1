"""The reduce agent's prompt: the caller's template, filled, then every input it reduces.

Shared by ``run_with_reduce`` and ``run_with_map_reduce`` (and the tree levels), so a reducer
always sees the same layout: outputs as one JSON object per line, in input order, then the
failures with their index, error kind and message. One line per item keeps a value's own text
(which may hold newlines or directives) from starting a line of the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.turnloop.compile import template_fields

# The fields a reduce template may name; each is filled per reduce agent.
REDUCE_FIELDS = {
    "n": "how many inputs this reduce agent receives (outputs + failures)",
    "ok": "how many of them are outputs",
    "failed": "how many of them are failures",
    "level": "the tree level, 1 for the first reduce (the only one without reduce_fan_in)",
}
CHARS_PER_TOKEN = 4  # the context estimate: ~4 characters per token for English and JSON


def check_reduce_template(template: Any) -> str:
    """Refuse a template that is not a string or names a field no reduce fills."""
    if not isinstance(template, str) or not template.strip():
        raise BatchSpecError(f"reduce must be a non-empty prompt template string, got "
                             f"{type(template).__name__}")
    try:
        names = template_fields(template)
    except BatchSpecError as exc:
        raise BatchSpecError(f"reduce template: {exc}") from None
    unknown = [n for n in names if n not in REDUCE_FIELDS]
    if unknown:
        allowed = ", ".join("{" + f + "}" for f in REDUCE_FIELDS)
        raise BatchSpecError(
            f"reduce template names {', '.join('{' + u + '}' for u in unknown)}, which no "
            f"reduce fills; it may use {allowed} (write literal braces as {{{{ and }}}})")
    return template


def check_fan_in(fan_in: Any) -> int | None:
    if fan_in is None:
        return None
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < 2:
        raise BatchSpecError(f"reduce_fan_in must be an int >= 2 (groups of that many outputs "
                             f"are reduced together), got {fan_in!r}")
    return fan_in


def check_reduce_schema(schema: Any) -> type[BaseModel]:
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise BatchSpecError(f"reduce_schema must be a Pydantic model class, got {schema!r}")
    return schema


def _output_json(result: AgentResult) -> Any:
    out = result.output
    if isinstance(out, BaseModel):
        return out.model_dump(mode="json")
    return out if out is not None else result.text


def render_reduce_prompt(template: str, items: Sequence[AgentResult], *, level: int,
                         indexes: Sequence[int] | None = None) -> str:
    """The template with ``{n}``, ``{ok}``, ``{failed}``, ``{level}`` filled, then the outputs
    and the failures. ``indexes`` labels each item (default: its ``AgentResult.index``)."""
    labels = list(indexes) if indexes is not None else [r.index for r in items]
    ok = [(i, r) for i, r in zip(labels, items, strict=True) if r.ok]
    failed = [(i, r) for i, r in zip(labels, items, strict=True) if not r.ok]
    head = template.format(n=len(items), ok=len(ok), failed=len(failed), level=level)
    lines = [head, "", f"Outputs ({len(ok)} of {len(items)}, one JSON object per line, "
             "in input order):"]
    lines += [json.dumps({"index": i, "output": _output_json(r)}, ensure_ascii=False)
              for i, r in ok] or ["(none)"]
    lines += ["", f"Failures ({len(failed)} of {len(items)}):"]
    lines += [json.dumps({"index": i, "kind": r.error.kind if r.error else "unknown",
                          "message": r.error.message if r.error else ""}, ensure_ascii=False)
              for i, r in failed] or ["(none)"]
    return "\n".join(lines)


def estimate_tokens(*texts: str | None) -> int:
    """A rough prompt size, ``chars / CHARS_PER_TOKEN``: agentbatch has no tokenizer for the
    reduce model, so the context check is an estimate, not a count."""
    return -(-sum(len(t or "") for t in texts) // CHARS_PER_TOKEN)

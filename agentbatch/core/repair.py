"""Recover a JSON value from what a model actually wrote.

Models wrap JSON in code fences, add prose around it, or leave trailing commas. Repair is
deliberately conservative: it only removes wrapping and fixes trailing commas; anything else
is reported so the agent gets a repair turn instead of a silently wrong value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")


class RepairError(ValueError):
    """No JSON value could be recovered from the text."""


def _balanced_spans(text: str) -> list[str]:
    """Top-level ``{...}`` / ``[...]`` spans, scanning strings correctly."""
    spans: list[str] = []
    depth = 0
    start = -1
    in_str = False
    escape = False
    for i, ch in enumerate(text):
        if in_str:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"' and depth > 0:
            in_str = True
        elif ch in "{[":
            if depth == 0:
                start = i
            depth += 1
        elif ch in "}]" and depth > 0:
            depth -= 1
            if depth == 0:
                spans.append(text[start : i + 1])
    return spans


def _loads(candidate: str) -> Any:
    try:
        return json.loads(candidate)
    except json.JSONDecodeError:
        return json.loads(_TRAILING_COMMA.sub(r"\1", candidate))


def extract_json(text: str | None) -> Any:
    """The first JSON object (or array) in ``text``, after unwrapping fences and prose."""
    if text is None or not text.strip():
        raise RepairError("the reply was empty")
    stripped = text.strip()
    last_error = "no JSON object found in the reply"
    for candidate in _candidates(stripped):
        if not candidate or candidate[0] not in "{[":
            continue
        try:
            return _loads(candidate)
        except json.JSONDecodeError as exc:
            last_error = f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    raise RepairError(last_error)


def _candidates(stripped: str) -> Iterator[str]:
    """The reply itself, then each fenced block, then each balanced span, made only as
    needed: a reply that is the JSON (nearly all) is not scanned char by char on every
    final turn (issue 26 item 5)."""
    yield stripped
    for m in _FENCE.finditer(stripped):
        yield m.group(1).strip()
    yield from _balanced_spans(stripped)

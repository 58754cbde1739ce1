"""Lenient parsing of OpenAI-style chat completion bodies into a ``ModelResponse``.

"OpenAI-compatible" servers disagree in the details: content may be null, a string or a list
of parts; tool-call arguments may be a JSON string or an already-parsed object (or broken JSON
from a small model); cached-token counts live in different places. A malformed *tool call*
is the model's mistake and goes back to the model (``arguments_error``); a malformed *body*
is the server's, and raises ``ServerError`` so the turn can be retried.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelResponse, ToolCall, Usage, unique_call_ids

MAX_RAW_ARGS_CHARS = 300


def _as_int(value: Any) -> int:
    """Token counts: tolerate null, floats and numeric strings; anything else counts as 0."""
    if type(value) is int:  # what every server sends: three per turn (issue 26 item 5)
        return value if value > 0 else 0
    if isinstance(value, bool):
        return 0
    if isinstance(value, (int, float)):
        return max(0, int(value))
    if isinstance(value, str):
        try:
            return max(0, int(float(value)))
        except ValueError:
            return 0
    return 0


def content_text(content: Any) -> str | None:
    """``message.content`` as text: null, a string, or a list of (text) parts."""
    if content is None:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") in ("text", "output_text"):
                text = part.get("text")
                if isinstance(text, str):
                    texts.append(text)
        return "".join(texts) if texts else None
    return str(content)


def parse_arguments(raw: Any) -> tuple[dict[str, Any], str | None]:
    """Tool-call arguments as a dict, or ``({}, reason)`` when they are not a JSON object."""
    if raw is None:
        return {}, None
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str):
        return {}, f"tool arguments must be a JSON object, got {type(raw).__name__}"
    if not raw.strip():
        return {}, None  # some servers send "" for a call without arguments
    try:
        value = json.loads(raw)
    except ValueError as exc:
        return {}, f"tool arguments are not valid JSON ({exc}): {_clip(raw)}"
    except RecursionError:  # the model's mistake, like any other bad arguments
        return {}, f"tool arguments are nested too deeply: {_clip(raw)}"
    if isinstance(value, str):  # double-encoded by some tool parsers
        try:
            inner = json.loads(value)
        except (ValueError, RecursionError):
            inner = None
        if isinstance(inner, dict):
            return inner, None
    if not isinstance(value, dict):
        return {}, f"tool arguments must be a JSON object, got {type(value).__name__}: {_clip(raw)}"
    return value, None


def _clip(raw: str) -> str:
    if len(raw) <= MAX_RAW_ARGS_CHARS:
        return raw
    return raw[:MAX_RAW_ARGS_CHARS] + f"... [{len(raw) - MAX_RAW_ARGS_CHARS} more chars]"


def _call_id(request_id: str, index: int, name: str, raw_args: Any) -> str:
    """A stable id for a call the server left unnamed, so replays produce identical messages."""
    seed = f"{request_id}|{index}|{name}|{raw_args!r}".encode()
    return "call_" + hashlib.sha256(seed).hexdigest()[:24]


def parse_tool_calls(raw_calls: Any, request_id: str) -> list[ToolCall]:
    """``message.tool_calls`` into ``ToolCall``s with unique ids; never raises on a malformed
    entry."""
    if not isinstance(raw_calls, list):
        return []
    calls: list[ToolCall] = []
    for index, entry in enumerate(raw_calls):
        if not isinstance(entry, dict):
            continue
        raw_fn = entry.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else entry
        raw_name = fn.get("name")
        name = raw_name if isinstance(raw_name, str) else ""
        raw_args = fn.get("arguments")
        arguments, error = parse_arguments(raw_args)
        if not name:
            error = error or "tool call has no function name"
        call_id = entry.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = _call_id(request_id, index, name, raw_args)
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments, arguments_error=error))
    # Here as well as in ModelResponse: a streamed call is announced early from this list.
    return unique_call_ids(calls)


def parse_usage(body: dict[str, Any]) -> Usage:
    """Token usage; cached tokens from wherever this server reports them."""
    usage = body.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    cached: Any = details.get("cached_tokens")
    if cached is None:
        cached = usage.get("cached_tokens")  # SGLang and some proxies
    if cached is None:
        cached = usage.get("prompt_cache_hit_tokens")  # DeepSeek-style
    if cached is None:
        meta = body.get("meta_info")
        if isinstance(meta, dict):
            cached = meta.get("cached_tokens")  # SGLang native field
    return Usage(
        prompt_tokens=_as_int(usage.get("prompt_tokens")),
        completion_tokens=_as_int(usage.get("completion_tokens")),
        cached_tokens=_as_int(cached),
    )


def parse_chat_completion(
    body: Any, *, request_id: str = "", who: str = "backend"
) -> ModelResponse:
    """A decoded chat completion body as a ``ModelResponse``; ``ServerError`` if it is not one."""
    if not isinstance(body, dict):
        raise ServerError(f"{who}: response is not a JSON object", status=200)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        err = body.get("error")
        detail = f": {str(err)[:300]}" if err else ""
        raise ServerError(f"{who}: response has no choices{detail}", status=200)
    choice = choices[0]
    message = choice.get("message")
    message = message if isinstance(message, dict) else {}
    finish = choice.get("finish_reason")
    return ModelResponse(
        text=content_text(message.get("content")),
        tool_calls=parse_tool_calls(message.get("tool_calls"), request_id),
        usage=parse_usage(body),
        finish_reason=finish if isinstance(finish, str) else None,
    )

"""Canonical requests to Anthropic Messages API bodies, and replies back (pure, no I/O).

Prompt caching: Anthropic caches the prefix up to a ``cache_control`` breakpoint, in the order
tools -> system -> messages. Every agent of a batch shares the same tools and system prompt, so
we mark the last tool and the last system block: after the first agent pays the cache write,
the rest read the shared prefix at a fraction of the price. The cache lives 5 minutes from
its last read by default; ``cache_ttl="1h"`` asks for Anthropic's 1-hour cache (a write costs
2x the input price instead of 1.25x, a read 0.1x either way), which is what provider batch
turns use: their rounds are minutes to hours apart. ``json_schema`` is not sent
(Anthropic has no ``response_format``); the engines put the schema in the prompt instead.
"""

from __future__ import annotations

from typing import Any

from agentbatch.backends.message_blocks import (
    Block,
    Image,
    Text,
    ToolResult,
    ToolUse,
    function_specs,
    split_messages,
    stop_reason,
)
from agentbatch.backends.openai_parse import _as_int, parse_arguments
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelRequest, ModelResponse, ToolCall, Usage

DEFAULT_MAX_TOKENS = 4096
CACHE = {"type": "ephemeral"}


def _block(block: Block) -> dict[str, Any]:
    if isinstance(block, Text):
        return {"type": "text", "text": block.text}
    if isinstance(block, ToolUse):
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    if isinstance(block, ToolResult):
        out: dict[str, Any] = {"type": "tool_result", "tool_use_id": block.tool_use_id}
        if block.text:  # content is optional; an empty string is not worth the risk
            out["content"] = block.text
        return out
    assert isinstance(block, Image)
    if block.data_b64:
        source = {"type": "base64", "media_type": block.media_type, "data": block.data_b64}
    else:
        source = {"type": "url", "url": block.url}
    return {"type": "image", "source": source}


def build_body(
    request: ModelRequest, *, model: str, default_max_tokens: int = DEFAULT_MAX_TOKENS,
    cache_ttl: str | None = None,
) -> dict[str, Any]:
    """The ``POST /v1/messages`` body for ``request``; ``cache_ttl`` ("5m" or "1h") on the
    shared prefix's cache breakpoints, else the API's default (5 minutes)."""
    cache: dict[str, str] = dict(CACHE) | ({"ttl": cache_ttl} if cache_ttl else {})
    system, turns = split_messages(request.messages)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens or default_max_tokens,
        "messages": [{"role": t.role, "content": [_block(b) for b in t.blocks]} for t in turns],
    }
    if system:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": s} for s in system]
        blocks[-1]["cache_control"] = dict(cache)
        body["system"] = blocks
    specs = function_specs(request.tools)
    if specs:
        tools: list[dict[str, Any]] = []
        for spec in specs:
            tool: dict[str, Any] = {"name": spec.name}
            if spec.description:
                tool["description"] = spec.description
            tool["input_schema"] = spec.parameters
            tools.append(tool)
        tools[-1]["cache_control"] = dict(cache)
        body["tools"] = tools
        if request.tool_choice in ("auto", "none"):
            body["tool_choice"] = {"type": request.tool_choice}
        elif request.tool_choice == "required":  # Anthropic's name for "some tool"
            body["tool_choice"] = {"type": "any"}
    if request.temperature is not None:
        body["temperature"] = request.temperature
    return body


def parse_usage(usage: Any) -> Usage:
    """Anthropic's ``input_tokens`` excludes cache reads and writes; ours includes both.

    Cache *writes* (``cache_creation_input_tokens``) are counted in ``prompt_tokens`` only:
    ``Usage`` has no field for them.
    """
    usage = usage if isinstance(usage, dict) else {}
    fresh = _as_int(usage.get("input_tokens"))
    read = _as_int(usage.get("cache_read_input_tokens"))
    written = _as_int(usage.get("cache_creation_input_tokens"))
    return Usage(
        prompt_tokens=fresh + read + written,
        cached_tokens=read,
        completion_tokens=_as_int(usage.get("output_tokens")),
    )


def parse_response(body: Any, *, who: str = "anthropic") -> ModelResponse:
    """A decoded Messages API reply as a ``ModelResponse``; ``ServerError`` if it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("content"), list):
        err = body.get("error") if isinstance(body, dict) else None
        detail = f": {str(err)[:300]}" if err else ""
        raise ServerError(f"{who}: response has no content{detail}", status=200)
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in body["content"]:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            arguments, error = parse_arguments(block.get("input"))
            raw_name = block.get("name")
            name = raw_name if isinstance(raw_name, str) else ""
            calls.append(
                ToolCall(
                    id=str(block.get("id") or f"toolu_{len(calls)}"),
                    name=name,
                    arguments=arguments,
                    arguments_error=error or (None if name else "no tool name"),
                )
            )
    text = "".join(texts)
    return ModelResponse(
        text=text or None,
        tool_calls=calls,
        usage=parse_usage(body.get("usage")),
        finish_reason=stop_reason(body.get("stop_reason")),
    )

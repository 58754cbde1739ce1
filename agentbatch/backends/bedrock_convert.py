"""Canonical requests to Bedrock Converse parameters, and replies back (pure, no boto3).

Prompt caching: a ``cachePoint`` block after the system prompt caches the shared prefix (tools
come before the system prompt, so they are cached with it). Bedrock rejects ``cachePoint`` for
models without prompt caching, so it is sent only where ``supports_prompt_caching`` says yes.

Tool choice: Converse has ``auto``/``any``/``tool`` but no ``none``. For ``none`` we omit
``toolChoice``, and drop ``toolConfig`` too unless the history holds tool blocks (Bedrock
insists on ``toolConfig`` then) -- so "none" is best effort there. A history with tool blocks
but no tools in the request gets minimal specs for the tool names it used, for the same reason.
"""

from __future__ import annotations

import re
from typing import Any

from agentbatch.backends.message_blocks import (
    Block,
    Image,
    Text,
    ToolResult,
    ToolUse,
    function_specs,
    has_tool_blocks,
    image_bytes,
    split_messages,
    stop_reason,
    tool_names,
)
from agentbatch.backends.openai_parse import _as_int, parse_arguments
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelRequest, ModelResponse, ToolCall, Usage

DEFAULT_MAX_TOKENS = 4096
EMPTY_RESULT = "(empty)"  # Bedrock has rejected blank text in tool results; never risk it
CACHE_POINT = {"cachePoint": {"type": "default"}}

# Bedrock model ids may carry a cross-region prefix ("us.", "eu.", "apac.", "global.", ...)
# or be an inference-profile ARN; caching support is decided on the bare id.
_REGION_PREFIX = re.compile(r"^[a-z-]{2,8}\.(?=[a-z]+\.)")
_CACHING_MODELS = re.compile(
    r"^(?:anthropic\.claude-(?:3-7-|3-5-haiku-|3-5-sonnet-20241022-v2|"
    r"(?:sonnet|opus|haiku)-(?:[4-9]|\d\d))"
    r"|amazon\.nova-(?:micro|lite|pro|premier|2-))"
)


def bare_model_id(model_id: str) -> str:
    """``us.anthropic.claude-...`` / an ARN -> ``anthropic.claude-...``."""
    bare = model_id.rsplit("/", 1)[-1].lower()
    return _REGION_PREFIX.sub("", bare)


def supports_prompt_caching(model_id: str) -> bool:
    """Bedrock prompt caching: Claude 3.5 Haiku, 3.5 Sonnet v2, 3.7 Sonnet, Claude 4+
    (Sonnet/Opus/Haiku) and Amazon Nova Micro/Lite/Pro/Premier (and Nova 2). Anything else,
    including older Claude 3 models, gets no ``cachePoint`` (it would be a ValidationException).
    """
    return bool(_CACHING_MODELS.match(bare_model_id(model_id)))


def _block(block: Block) -> dict[str, Any] | None:
    if isinstance(block, Text):
        return {"text": block.text}
    if isinstance(block, ToolUse):
        return {"toolUse": {"toolUseId": block.id, "name": block.name, "input": block.input}}
    if isinstance(block, ToolResult):
        text = block.text if block.text.strip() else EMPTY_RESULT
        return {"toolResult": {"toolUseId": block.tool_use_id, "content": [{"text": text}]}}
    assert isinstance(block, Image)
    inline = image_bytes(block)
    if inline is None or inline[0] not in ("png", "jpeg", "gif", "webp"):
        return {"text": "[image omitted: Bedrock needs inline png/jpeg/gif/webp]"}
    return {"image": {"format": inline[0], "source": {"bytes": inline[1]}}}


def _tool_config(
    request: ModelRequest, history_has_tools: bool, used: list[str]
) -> dict[str, Any] | None:
    specs = function_specs(request.tools)
    if request.tool_choice == "none" and not history_has_tools:
        return None
    tools = [
        {
            "toolSpec": {
                "name": s.name,
                "description": s.description or s.name,
                "inputSchema": {"json": s.parameters},
            }
        }
        for s in specs
    ]
    if not tools and history_has_tools:
        tools = [
            {
                "toolSpec": {
                    "name": name,
                    "description": name,
                    "inputSchema": {"json": {"type": "object"}},
                }
            }
            for name in used
        ]
    if not tools:
        return None
    config: dict[str, Any] = {"tools": tools}
    if request.tool_choice == "auto":
        config["toolChoice"] = {"auto": {}}
    elif request.tool_choice == "required":  # Converse's name for "some tool"
        config["toolChoice"] = {"any": {}}
    return config


def converse_params(
    request: ModelRequest, *, model_id: str, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> dict[str, Any]:
    """Keyword arguments for ``client.converse`` for ``request``."""
    system, turns = split_messages(request.messages)
    messages = []
    for turn in turns:
        content = [b for b in (_block(x) for x in turn.blocks) if b is not None]
        messages.append({"role": turn.role, "content": content})
    params: dict[str, Any] = {"modelId": model_id, "messages": messages}
    if system:
        blocks: list[dict[str, Any]] = [{"text": s} for s in system]
        if supports_prompt_caching(model_id):
            blocks.append(dict(CACHE_POINT))
        params["system"] = blocks
    inference: dict[str, Any] = {"maxTokens": request.max_tokens or default_max_tokens}
    if request.temperature is not None:
        inference["temperature"] = request.temperature
    params["inferenceConfig"] = inference
    config = _tool_config(request, has_tool_blocks(turns), tool_names(turns))
    if config is not None:
        params["toolConfig"] = config
    return params


def parse_usage(usage: Any) -> Usage:
    """``inputTokens`` excludes cache reads/writes (as on Anthropic); ours includes both."""
    usage = usage if isinstance(usage, dict) else {}
    fresh = _as_int(usage.get("inputTokens"))
    read = _as_int(usage.get("cacheReadInputTokens"))
    written = _as_int(usage.get("cacheWriteInputTokens"))
    return Usage(
        prompt_tokens=fresh + read + written,
        cached_tokens=read,
        completion_tokens=_as_int(usage.get("outputTokens")),
    )


def parse_converse(response: Any, *, who: str = "bedrock") -> ModelResponse:
    """A ``converse`` reply as a ``ModelResponse``; ``ServerError`` if it has no message."""
    output = response.get("output") if isinstance(response, dict) else None
    message = output.get("message") if isinstance(output, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        raise ServerError(f"{who}: converse response has no output message", status=200)
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif isinstance(block.get("toolUse"), dict):
            use = block["toolUse"]
            arguments, error = parse_arguments(use.get("input"))
            name = use.get("name") if isinstance(use.get("name"), str) else ""
            calls.append(
                ToolCall(
                    id=str(use.get("toolUseId") or f"tooluse_{len(calls)}"),
                    name=name,
                    arguments=arguments,
                    arguments_error=error or (None if name else "no tool name"),
                )
            )
    text = "".join(texts)
    return ModelResponse(
        text=text or None,
        tool_calls=calls,
        usage=parse_usage(response.get("usage")),
        finish_reason=stop_reason(response.get("stopReason")),
    )

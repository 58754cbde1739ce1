"""Canonical (OpenAI chat) messages as neutral content blocks, for block-based APIs.

Anthropic Messages and Bedrock Converse both want: the system prompt apart, strictly
alternating user/assistant turns, tool calls and results as typed blocks, tool results as
*user* content (first in their turn), and no blank text block anywhere -- Bedrock rejects a
whitespace-only text block with a ``ValidationException`` that then fails every replay of the
conversation. This module does all of that once; each driver only renders the neutral blocks
into its wire format.

Rules: leading system messages form the system prompt; a system message later in the
conversation becomes user text (moving it would change the cached prefix); adjacent turns of
the same role are merged; turns left empty are dropped; a conversation that would start with
the assistant gets a minimal user turn first.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbatch.backends.openai_parse import content_text, parse_arguments
from agentbatch.core.model_io import Message

FIRST_TURN_PLACEHOLDER = "(continue)"
_ID_BAD = re.compile(r"[^A-Za-z0-9_-]")
_DATA_URL = re.compile(r"^data:(image/[A-Za-z0-9.+-]+);base64,(.*)$", re.DOTALL)

# Provider stop reasons in the canonical (OpenAI) vocabulary; unknown ones pass through.
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "content_filtered": "content_filter",
    "guardrail_intervened": "content_filter",
}


@dataclass
class Text:
    text: str


@dataclass
class Image:
    media_type: str = ""  # e.g. "image/png" for inline data
    data_b64: str = ""
    url: str = ""  # a remote image, when not inline


@dataclass
class ToolUse:
    id: str
    name: str
    input: dict[str, Any]


@dataclass
class ToolResult:
    tool_use_id: str
    text: str


Block = Text | Image | ToolUse | ToolResult


@dataclass
class Turn:
    role: Literal["user", "assistant"]
    blocks: list[Block] = field(default_factory=list)


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str
    parameters: dict[str, Any]


def safe_id(raw: Any) -> str:
    """Tool-use ids as both APIs accept them (``[A-Za-z0-9_-]+``), mapped the same everywhere."""
    text = _ID_BAD.sub("_", str(raw or ""))
    return text or "tool_call"


def stop_reason(raw: Any) -> str | None:
    return STOP_REASONS.get(raw, raw) if isinstance(raw, str) else None


def function_specs(tools: list[dict[str, Any]]) -> list[FunctionSpec]:
    """OpenAI function-tool schemas (or bare ``{name, description, parameters}``)."""
    specs = []
    for tool in tools:
        raw_fn = tool.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        params = fn.get("parameters")
        if not isinstance(params, dict):
            params = {"type": "object", "properties": {}}
        specs.append(FunctionSpec(name, str(fn.get("description") or ""), params))
    return specs


def _blank(text: str | None) -> bool:
    return not text or not text.strip()


def _content_blocks(content: Any) -> list[Block]:
    """User/assistant ``content`` (string or parts) as blocks, blank text dropped."""
    if isinstance(content, list):
        blocks: list[Block] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, dict) else image
                if isinstance(url, str) and (m := _DATA_URL.match(url)):
                    blocks.append(Image(media_type=m.group(1), data_b64=m.group(2)))
                elif isinstance(url, str) and url:
                    blocks.append(Image(url=url))
                continue
            text = content_text([part])
            if not _blank(text):
                blocks.append(Text(text or ""))
        return blocks
    text = content_text(content)
    return [] if _blank(text) else [Text(text or "")]


def _assistant_blocks(msg: Message) -> list[Block]:
    blocks = _content_blocks(msg.get("content"))
    calls = msg.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        if not isinstance(call, dict):
            continue
        raw_fn = call.get("function")
        fn: dict[str, Any] = raw_fn if isinstance(raw_fn, dict) else call
        arguments, _ = parse_arguments(fn.get("arguments"))
        blocks.append(ToolUse(safe_id(call.get("id")), str(fn.get("name") or ""), arguments))
    return blocks


def split_messages(messages: list[Message]) -> tuple[list[str], list[Turn]]:
    """``(system texts, turns)`` following the module's rules."""
    system: list[str] = []
    turns: list[Turn] = []
    leading = True
    for msg in messages:
        role = msg.get("role")
        if role == "system" and leading:
            text = content_text(msg.get("content"))
            if not _blank(text):
                system.append(text or "")
            continue
        leading = False
        if role == "assistant":
            turn = Turn("assistant", _assistant_blocks(msg))
        elif role == "tool":
            result = content_text(msg.get("content")) or ""
            turn = Turn("user", [ToolResult(safe_id(msg.get("tool_call_id")), result)])
        else:  # user, a late system message, or an unknown role: the user speaks
            turn = Turn("user", _content_blocks(msg.get("content")))
        if not turn.blocks:
            continue
        if turns and turns[-1].role == turn.role:
            turns[-1].blocks.extend(turn.blocks)
        else:
            turns.append(turn)
    for turn in turns:
        if turn.role == "user":  # both APIs want tool results before any other user content
            turn.blocks.sort(key=lambda b: not isinstance(b, ToolResult))
    if turns and turns[0].role != "user":
        turns.insert(0, Turn("user", [Text(FIRST_TURN_PLACEHOLDER)]))
    return system, turns


def has_tool_blocks(turns: list[Turn]) -> bool:
    return any(isinstance(b, ToolUse | ToolResult) for t in turns for b in t.blocks)


def tool_names(turns: list[Turn]) -> list[str]:
    """Names of tools the history used, in first-use order."""
    seen: dict[str, None] = {}
    for turn in turns:
        for b in turn.blocks:
            if isinstance(b, ToolUse) and b.name:
                seen.setdefault(b.name)
    return list(seen)


def image_bytes(image: Image) -> tuple[str, bytes] | None:
    """``(format, raw bytes)`` of an inline image (``format`` like ``png``); None if remote."""
    if not image.data_b64:
        return None
    try:
        raw = base64.b64decode(image.data_b64, validate=False)
    except ValueError:
        return None
    fmt = image.media_type.split("/", 1)[-1].lower()
    return ("jpeg" if fmt == "jpg" else fmt), raw

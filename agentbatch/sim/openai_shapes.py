"""OpenAI wire shapes: completion bodies, streaming chunks, SSE framing, error bodies.

Kept apart from the handlers so the exact JSON a client sees is easy to audit and test.
"""

from __future__ import annotations

import json
import math
from typing import Any

from agentbatch.sim.script import EmittedCall, Reply


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def error_body(message: str, type_: str, code: int | str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": type_, "param": None, "code": code},
        "object": "error",
    }


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def _tool_call_part(call: EmittedCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def chat_completion(
    rid: str, model: str, created: int, reply: Reply, usage_: dict[str, Any]
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [_tool_call_part(c) for c in reply.tool_calls]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}
        ],
        "usage": usage_,
    }


def text_completion(
    rid: str,
    model: str,
    created: int,
    texts: list[str],
    usage_: dict[str, Any],
    finish_reasons: list[str] | None = None,
) -> dict[str, Any]:
    reasons = finish_reasons or ["stop"] * len(texts)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": i, "text": t, "logprobs": None, "finish_reason": reasons[i]}
            for i, t in enumerate(texts)
        ],
        "usage": usage_,
    }


def split_text(text: str, max_piece: int = 16, min_pieces: int = 3) -> list[str]:
    """Split into pieces of at most ``max_piece`` chars and, if possible, ``min_pieces`` pieces.

    Clients must reassemble fragments, so even short strings arrive split.
    """
    if not text:
        return []
    size = max(1, min(max_piece, math.ceil(len(text) / min_pieces)))
    return [text[i : i + size] for i in range(0, len(text), size)]


def chat_deltas(reply: Reply) -> list[dict[str, Any]]:
    """The ``delta`` objects after the role delta: content pieces, then each tool call
    (id, type and name in its first piece, arguments spread over the following pieces)."""
    deltas: list[dict[str, Any]] = [{"content": p} for p in split_text(reply.content or "")]
    for index, call in enumerate(reply.tool_calls):
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": ""},
                    }
                ]
            }
        )
        for piece in split_text(call.arguments):
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas


class ChunkMaker:
    """Builds ``chat.completion.chunk`` / streamed ``text_completion`` objects for one request."""

    def __init__(self, rid: str, model: str, created: int, chat: bool, include_usage: bool):
        self.rid, self.model, self.created = rid, model, created
        self.object = "chat.completion.chunk" if chat else "text_completion"
        self.include_usage = include_usage

    def _base(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.rid,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def chat(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return self._base(
            [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )

    def text(self, index: int, text: str, finish_reason: str | None = None) -> dict[str, Any]:
        return self._base(
            [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        )

    def usage(self, usage_: dict[str, Any]) -> dict[str, Any]:
        chunk = self._base([])
        chunk["usage"] = usage_
        return chunk

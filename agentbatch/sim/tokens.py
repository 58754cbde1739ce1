"""Approximate token counting and a vLLM-style prefix cache (pure: no IO).

Counting is ``ceil(chars / 4)`` over one flat rendering of the request. What matters is not
accuracy but that identical prefixes render to identical text, so the prefix cache rewards
exactly the prompt layouts that a real server's cache would reward.

Also the sim's own chat template and code-point tokenizer, behind vLLM's ``/tokenize`` and
``/detokenize``, so a client rendering batched prompts with the server's template is tested.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from agentbatch.core.model_io import Message, canonical_json
from agentbatch.sim.script import content_text

CHARS_PER_TOKEN = 4
BLOCK_TOKENS = 16
BLOCK_CHARS = BLOCK_TOKENS * CHARS_PER_TOKEN


def count_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def render_chat(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> str:
    """One string per request: ``<|role|>content[tool_calls]``, tools right after the system."""
    parts: list[str] = []
    tools_text = "<|tools|>" + canonical_json(tools) if tools else ""
    for i, msg in enumerate(messages):
        if i == 0 and tools_text and msg.get("role") != "system":
            parts.append(tools_text)
            tools_text = ""
        parts.append(f"<|{msg.get('role', 'user')}|>" + content_text(msg.get("content")))
        if msg.get("tool_calls"):
            parts.append(canonical_json(msg["tool_calls"]))
        if i == 0 and tools_text:
            parts.append(tools_text)
            tools_text = ""
    parts.append(tools_text)
    return "".join(parts)


# The sim's chat template for ``/tokenize`` (deliberately not ChatML, so a client that renders
# with the server's template is told apart from one that hard-codes ChatML). Contents start
# and end on their own lines, so ``@sim`` directives in them are still read from the prompt.
TEMPLATE_TURN = "<|sim:{role}|>\n{content}\n"
TEMPLATE_GENERATION = "<|sim:assistant|>\n"
MAX_MODEL_LEN = 131072
MAX_CODE_POINT = 0x10FFFF


def render_template(messages: list[Message], add_generation_prompt: bool = True) -> str:
    """``messages`` in the sim's chat template (what ``/tokenize`` applies)."""
    parts = [
        TEMPLATE_TURN.format(role=m.get("role", "user"), content=content_text(m.get("content")))
        for m in messages
    ]
    if add_generation_prompt:
        parts.append(TEMPLATE_GENERATION)
    return "".join(parts)


def encode(text: str) -> list[int]:
    """The sim's tokenizer: one token per code point, so ``decode`` round-trips exactly."""
    return [ord(ch) for ch in text]


def decode(tokens: list[int]) -> str:
    """Text of ``tokens``; ``ValueError`` for ids that are not code points."""
    if not all(type(t) is int and 0 <= t <= MAX_CODE_POINT for t in tokens):
        raise ValueError("tokens must be integers in [0, 0x10FFFF]")
    return "".join(map(chr, tokens))


def block_hashes(text: str) -> list[int]:
    """Chained hashes of the full 64-char blocks: block i's hash covers blocks 0..i.

    Python's ``hash`` is fast and stable within one process, which is all an in-memory cache
    needs.
    """
    hashes: list[int] = []
    h = 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[start : start + BLOCK_CHARS]))
        hashes.append(h)
    return hashes


def cached_tokens(cached_blocks: int, prompt_tokens: int) -> int:
    """Tokens served from cache; like vLLM, at least one prompt token is always computed."""
    cached = cached_blocks * BLOCK_TOKENS
    while cached >= prompt_tokens and cached > 0:
        cached -= BLOCK_TOKENS
    return max(cached, 0)


class PrefixCache:
    """LRU set of block chain-hashes; a request's cached prefix is its leading cached blocks."""

    def __init__(self, capacity_blocks: int = 100_000) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks are cached (they count as recently used)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def match_and_insert(self, hashes: list[int]) -> int:
        """Look up then insert: what one prefill does to a vLLM-style cache."""
        n = self.match(hashes)
        self.insert(hashes[n:])
        return n

    def clear(self) -> None:
        self._blocks.clear()

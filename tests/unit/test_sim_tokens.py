"""Token counting, request rendering and the vLLM-style prefix cache."""

from __future__ import annotations

from agentbatch.sim.tokens import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    PrefixCache,
    block_hashes,
    cached_tokens,
    count_tokens,
    render_chat,
)

SYSTEM = "You are a careful agent. " * 40  # ~1000 chars: many full blocks
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def test_count_tokens_rounds_up():
    assert count_tokens("") == 0
    assert count_tokens("abcd") == 1
    assert count_tokens("abcde") == 2


def test_render_places_tools_after_system_and_includes_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "U"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "T"},
    ]
    text = render_chat(messages, TOOLS)
    assert text.startswith("<|system|>S<|tools|>[")
    assert (
        text.index("<|tools|>")
        < text.index("<|user|>U")
        < text.index('"c1"')
        < text.index("<|tool|>T")
    )
    assert render_chat(messages[1:2], TOOLS).startswith("<|tools|>")
    assert render_chat(messages[1:2]) == "<|user|>U"


def test_block_hashes_are_chained_over_full_blocks():
    a = block_hashes("x" * (BLOCK_CHARS * 3 + 10))
    assert len(a) == 3
    assert len(set(a)) == 3  # identical blocks at different positions hash differently
    b = block_hashes("y" + "x" * (BLOCK_CHARS * 3 + 9))
    assert not set(a) & set(b)  # a change in block 0 changes every later hash


def test_shared_prefix_hits_the_cache():
    cache = PrefixCache(1000)
    first = render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task one"}], TOOLS
    )
    second = render_chat(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task two"}], TOOLS
    )
    assert cache.match_and_insert(block_hashes(first)) == 0
    hit = cache.match_and_insert(block_hashes(second))
    shared = len(SYSTEM) // BLOCK_CHARS
    assert hit >= shared
    assert 0 < cached_tokens(hit, count_tokens(second)) <= hit * BLOCK_TOKENS


def test_cached_tokens_leave_at_least_one_token_to_compute():
    assert cached_tokens(4, 64) == 48
    assert cached_tokens(4, 65) == 64
    assert cached_tokens(0, 10) == 0


def test_lru_eviction():
    cache = PrefixCache(capacity_blocks=4)
    a = block_hashes("a" * BLOCK_CHARS * 3)
    b = block_hashes("b" * BLOCK_CHARS * 3)
    cache.insert(a)
    cache.insert(b)
    assert len(cache) == 4
    assert cache.match(a) == 0  # a's first block was evicted, so no prefix of a is cached
    assert cache.match(b) == 3
    cache.clear()
    assert len(cache) == 0

"""How ready turns are cut into provider batches: at most the client's ``max_items``, at
least its ``min_items`` (Bedrock's per-job minimum); a short tail joins the chunk before it
when that fits, and what still falls short is set apart for the sync API."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agentbatch.turnloop.batch_turns import MAX_ITEMS, below_min, split_chunks


@dataclass
class Sizes:
    min_items: int = 1
    max_items: int = MAX_ITEMS


@pytest.mark.parametrize(("ready", "sizes", "chunks", "short"), [
    (0, Sizes(), [], 0),
    (5, Sizes(), [5], 0),
    (20, Sizes(), [8, 8, 4], 0),  # OpenAI / Anthropic: small batches, any size
    (20, Sizes(min_items=5, max_items=8), [8, 8], 4),  # 8 + 4 > 8: the tail cannot join
    (10, Sizes(min_items=3, max_items=8), [8], 2),  # 8 + 2 > 8: the tail cannot join
    (10, Sizes(min_items=3, max_items=12), [10], 0),  # one chunk: 10 >= 3
    (250, Sizes(min_items=100, max_items=50_000), [250], 0),  # Bedrock: one job
    (99, Sizes(min_items=100, max_items=50_000), [], 99),  # Bedrock: too few, all to sync
    (130, Sizes(min_items=100, max_items=120), [120], 10),
    (7, object(), [7], 0),  # a client without the attributes: today's defaults
])
def test_split_chunks(ready: int, sizes: object, chunks: list[int], short: int) -> None:
    turns = list(range(ready))
    got, rest = split_chunks(turns, sizes)
    assert [len(c) for c in got] == chunks
    assert len(rest) == short
    assert [t for c in got for t in c] + rest == turns  # nothing lost, nothing twice, in order


def test_a_turn_below_the_minimum_gets_a_retryable_error_naming_it() -> None:
    item = below_min("c1", 3, Sizes(min_items=100))
    assert item.error is not None and item.error.retryable
    assert "3 turns" in item.error.message and "100" in item.error.message

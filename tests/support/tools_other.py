"""A second tool module for identity tests: a different tool with the same name as one in
``tests.support.tools`` (``price``), importable by worker processes."""

from __future__ import annotations

from agentbatch import tool
from tests.support.tools import _count_redis


@tool(cacheable=True)
async def price(item: str) -> str:
    """The price of an item in catalogue B (cacheable, shared within one batch).

    Args:
        item: the item.
    """
    await _count_redis().incr(f"test:exec:price:b:{item}")
    return f"b-price-of-{item}"

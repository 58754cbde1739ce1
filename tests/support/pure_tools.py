"""Tools that touch nothing but their arguments: for tests whose workers may not reach any
Redis key outside agentbatch's own (the ACL test's worker user)."""

from __future__ import annotations

from agentbatch import ToolContext, tool


@tool(cacheable=True)
async def shout(text: str) -> str:
    """Upper-case a text (cached within the batch).

    Args:
        text: what to upper-case.
    """
    return text.upper()


@tool
async def stamp(key: str, ctx: ToolContext) -> str:
    """Tag a key with this call's idempotency key (a side-effecting tool's shape).

    Args:
        key: what to tag.
    """
    return f"{key}@{ctx.idempotency_key}"

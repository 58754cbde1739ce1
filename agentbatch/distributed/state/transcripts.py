"""Kept conversations in Redis: what ``AgentResult.messages`` and ``agentbatch show`` read.

An agent's msgs list (``BatchKeys.messages``) holds its conversation while it runs. The
commit that ends it deletes the list, unless the batch keeps transcripts or the agent failed
(``finish.keeps_transcript``): then ``commit.lua`` keeps it with the batch's retention TTL and
marks the agent's results-stream entry ``m`` = ``"1"``. The messages are never copied into
the stream entry, so a batch that keeps nothing reads results as small as before; a reader
fetches the kept lists of the entries it got in one pipelined round trip.
"""

from __future__ import annotations

import json
from typing import Any

from agentbatch.core.agent_state import AgentState
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import with_messages
from agentbatch.distributed.state.replies import Entries

KEPT_FIELD = "m"  # in a results-stream entry: "1" when the agent's msgs list was kept


def kept_indices(entries: Entries) -> list[int]:
    """The agents among ``entries`` whose conversation was kept."""
    return [int(fields["i"]) for _, fields in entries if fields.get(KEPT_FIELD) == "1"]


def _decoded(indices: list[int], lists: list[list[str]]) -> dict[int, list[dict[str, Any]]]:
    return {i: [json.loads(m) for m in raw] for i, raw in zip(indices, lists, strict=True)}


def read_kept(client: Any, keys: BatchKeys, entries: Entries) -> dict[int, list[dict[str, Any]]]:
    """index -> kept conversation, for the marked ones of ``entries`` (sync client)."""
    indices = kept_indices(entries)
    if not indices:
        return {}
    with client.pipeline(transaction=False) as p:
        for i in indices:
            p.lrange(keys.messages(i), 0, -1)
        return _decoded(indices, p.execute())


async def aread_kept(client: Any, keys: BatchKeys, entries: Entries
                     ) -> dict[int, list[dict[str, Any]]]:
    """``read_kept`` for an async client."""
    indices = kept_indices(entries)
    if not indices:
        return {}
    async with client.pipeline(transaction=False) as p:
        for i in indices:
            p.lrange(keys.messages(i), 0, -1)
        return _decoded(indices, await p.execute())


def stored_agent(client: Any, keys: BatchKeys, index: int) -> tuple[AgentState | None, bool]:
    """(state, kept) of one agent as Redis holds it now: the state with its conversation
    (a running agent's so far: its state entry's submitted messages, then its list; an
    ended one's when it was kept), and whether there is one. (None, False): no such agent."""
    with client.pipeline(transaction=False) as p:
        p.hget(keys.state, index)
        p.lrange(keys.messages(index), 0, -1)
        entry, listed = p.execute()
    if entry is None:
        return None, False
    state = with_messages(entry, listed)
    return state, bool(listed) or not state.terminal

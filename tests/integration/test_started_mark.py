"""The sweep's "started" mark, stored as what it means: the batch's ``started`` hash names the
version last started (a claim, or a tool call of it). The version a commit writes is not
started, and a re-send drops the mark (the re-sent version counts as queued until a worker
starts it). The commit's variable-length parts (messages, task payloads) travel as JSON
arrays and arrive byte for byte, non-ASCII included."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from agentbatch.core.agent_state import AgentState
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.redis_store import BatchStore, state_entry, stored_state
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.transition import Transition

QUEUE = "test:started-mark:queue"


async def _walk(redis_url: str) -> dict[str, Any]:
    client = async_client(redis_url)
    try:
        store = BatchStore(client, Scripts(client), "started-mark")
        state = AgentState(index=0, input={})
        await client.hset(store.k.state, "0", state_entry(0, stored_state(state)))
        await client.zadd(store.k.watch, {store.k.member(0): 0})
        seen: dict[str, Any] = {"submitted": (await store.inspect(0)).started}
        token = uuid.uuid4().hex
        claim = await store.claim_turn(0, 0, token, 30_000)
        assert claim.kind == "ok" and claim.state is not None
        seen["claimed"] = (await store.inspect(0)).started
        seen["mark"] = await client.hget(store.k.started, "0")
        reply = {"role": "assistant", "content": "naïve 😀 \"quoted\" \\ back"}
        new = claim.state.model_copy(update={"version": 1, "messages": [reply]})
        seen["won"] = await store.commit(Transition(
            claim.state, new, token=token, deadline_ms=1,
            enqueue=[(QUEUE, "task ü 1"), (QUEUE, "task ü 2")]))
        seen["committed"] = (await store.inspect(0)).started
        seen["messages"] = [json.loads(m) for m in await client.lrange(store.k.messages(0), 0,
                                                                       -1)]
        seen["queued"] = await client.lrange(QUEUE, 0, -1)
        again = uuid.uuid4().hex
        claim = await store.claim_turn(0, 1, again, 30_000)
        assert claim.kind == "ok" and claim.state is not None
        seen["claimed again"] = (await store.inspect(0)).started
        await store.release(0, again)  # its worker died: the lease is gone
        seen["resends"] = await store.resend(claim.state, [(QUEUE, "re-sent")], recheck_ms=1000,
                                             max_resends=3)
        seen["resent"] = (await store.inspect(0)).started
        return seen
    finally:
        await client.aclose()


def test_the_started_hash_names_the_version_started_and_nothing_else(redis_url: str) -> None:
    seen = asyncio.run(_walk(redis_url))
    assert seen["submitted"] is False
    assert seen["claimed"] is True and seen["mark"] == "0"
    assert seen["won"] is True
    assert seen["committed"] is False  # version 1 is new: only queued
    assert seen["messages"] == [{"role": "assistant", "content": "naïve 😀 \"quoted\" \\ back"}]
    assert seen["queued"] == ["task ü 2", "task ü 1"]  # LPUSH, in order
    assert seen["claimed again"] is True
    assert seen["resends"] == 1
    assert seen["resent"] is False  # queued again until a worker starts it

"""Where a leftover sync hedge intent is counted, on a real redis-server with the real scripts.

A worker about to send a provider-batch turn's sync hedge request records it in the batch's
``pbatch`` hash (``ProviderBatches.hedge_intent``), and the commit of that version clears it
(``ProviderBatches.forget``). One left by a holder that did not commit (killed, or its lease
lapsed, with the request in flight: the provider bills it) is counted once, as
``stat:hedge_sync_paid_unknown``, by whoever takes the turn over: the sweep's re-send
(``resend.lua``), a duplicate delivery's commit (``forget``) or that delivery's own hedge
(``hedge_intent``). The holder's own intent is never counted. The end-to-end case, a worker
SIGKILLed mid-hedge, is ``test_hedge_killed_worker_distributed.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from agentbatch.core.agent_state import AgentState
from agentbatch.distributed.provider_batches import (
    RECORD_TTL_MS,
    ProviderBatches,
    intent_field,
    record_field,
)
from agentbatch.distributed.state.redis_store import BatchStore, state_entry, stored_state
from agentbatch.distributed.state.scripts import Scripts

pytestmark = pytest.mark.redis

STAT = "stat:hedge_sync_paid_unknown"
QUEUE = "test:hedge-intent:queue"


async def _store(client: Any, name: str) -> BatchStore:
    store = BatchStore(client, Scripts(client), f"hedge-intent-{name}")
    await client.hset(store.k.meta, mapping={"total": 1})
    await client.hset(store.k.state, "0", state_entry(0, stored_state(AgentState(index=0,
                                                                                 input={}))))
    await client.zadd(store.k.watch, {store.k.member(0): 0})
    return store


async def _paid_unknown(client: Any, store: BatchStore) -> int:
    return int(await client.hget(store.k.meta, STAT) or 0)


async def test_the_holders_own_intent_is_cleared_by_its_commit_and_not_counted(
        redis_client: Any) -> None:
    store = await _store(redis_client, "own")
    token = uuid.uuid4().hex
    await redis_client.hset(store.k.provider_batches, record_field(0, 0), "batch_1")
    await ProviderBatches.hedge_intent(store, 0, 0, token)
    assert await redis_client.hget(store.k.provider_batches, intent_field(0, 0)) == token
    assert await redis_client.pttl(store.k.provider_batches) > 0  # the record's TTL kept

    await ProviderBatches.forget(store, 0, 0, token)
    assert await redis_client.hlen(store.k.provider_batches) == 0  # record and intent gone
    assert await _paid_unknown(redis_client, store) == 0


async def test_an_intent_written_into_no_record_gets_the_records_ttl(redis_client: Any) -> None:
    store = await _store(redis_client, "ttl")
    await ProviderBatches.hedge_intent(store, 0, 0, uuid.uuid4().hex)
    assert 0 < await redis_client.pttl(store.k.provider_batches) <= RECORD_TTL_MS


async def test_a_duplicate_deliverys_commit_counts_the_intent_another_holder_left(
        redis_client: Any) -> None:
    store = await _store(redis_client, "dup")
    await ProviderBatches.hedge_intent(store, 0, 0, "dead-holder")
    await ProviderBatches.forget(store, 0, 0, "taker")
    await ProviderBatches.forget(store, 0, 0, "dead-holder")  # nothing left to count
    assert await _paid_unknown(redis_client, store) == 1
    assert await redis_client.hlen(store.k.provider_batches) == 0


async def test_a_new_hedge_over_another_holders_intent_counts_it_and_takes_its_place(
        redis_client: Any) -> None:
    store = await _store(redis_client, "rehedge")
    await ProviderBatches.hedge_intent(store, 0, 0, "dead-holder")
    await ProviderBatches.hedge_intent(store, 0, 0, "taker")
    await ProviderBatches.hedge_intent(store, 0, 0, "taker")  # its own: not again
    assert await _paid_unknown(redis_client, store) == 1
    await ProviderBatches.forget(store, 0, 0, "taker")
    assert await _paid_unknown(redis_client, store) == 1
    assert await redis_client.hlen(store.k.provider_batches) == 0


async def test_the_sweeps_resend_counts_a_dead_holders_intent_once(redis_client: Any) -> None:
    store = await _store(redis_client, "resend")
    token = uuid.uuid4().hex
    claim = await store.claim_turn(0, 0, token, 30_000)
    assert claim.kind == "ok" and claim.state is not None
    await ProviderBatches.hedge_intent(store, 0, 0, token)
    await store.release(0, token)  # its worker died: the lease is gone
    assert await store.resend(claim.state, [(QUEUE, "re-sent")], recheck_ms=1000,
                              max_resends=3) == 1
    assert await redis_client.hget(store.k.provider_batches, intent_field(0, 0)) is None
    assert await _paid_unknown(redis_client, store) == 1
    assert await redis_client.hget(store.k.meta, "stat:recovered") == "1"
    # re-sent again (its next holder died too, without a hedge): nothing more to count
    assert await store.resend(claim.state, [(QUEUE, "re-sent")], recheck_ms=1000,
                              max_resends=3) == 2
    assert await _paid_unknown(redis_client, store) == 1

"""A plain sync model turn whose worker dies after starting it, on the distributed engine: its
request may have reached the provider, which bills it, and no commit carries it. The turn is
re-sent and runs again, so the batch must say that its first run may have been paid
(``stat:sync_turn_maybe_paid``, counted by ``resend.lua`` with the re-send), beside
``stat:recovered``. A re-sent tool round, a turn waiting in a provider batch (the re-sent turn
adopts the batch: nothing is paid again) and a turn whose hedge intent is already counted
(``stat:hedge_sync_paid_unknown``) are not counted here.

Script-level cases on a real redis-server with the real scripts; the end-to-end case SIGKILLs
a real ``agentbatch worker`` while the simulator holds its request over real HTTP. Counts
only, never timings.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import submit_batch
from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.distributed.provider_batches import ProviderBatches, record_field
from agentbatch.distributed.state.redis_store import BatchStore, state_entry, stored_state
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import sim_url
from tests.support.tools import Answer
from tests.support.waits import poll_until

pytestmark = pytest.mark.redis

STAT = "stat:sync_turn_maybe_paid"
QUEUE = "test:sync-turn-paid:queue"


async def _store(client: Any, name: str) -> BatchStore:
    store = BatchStore(client, Scripts(client), f"sync-turn-paid-{name}-{uuid.uuid4().hex[:6]}")
    await client.hset(store.k.meta, mapping={"total": 1})
    await client.hset(store.k.state, "0", state_entry(0, stored_state(AgentState(index=0,
                                                                                 input={}))))
    await client.zadd(store.k.watch, {store.k.member(0): 0})
    return store


async def _count(client: Any, store: BatchStore, stat: str = STAT) -> int:
    return int(await client.hget(store.k.meta, stat) or 0)


async def _died_holding(store: BatchStore) -> AgentState:
    """A worker claims agent 0's model turn (marked started) and dies: its lease is gone."""
    token = uuid.uuid4().hex
    claim = await store.claim_turn(0, 0, token, 30_000)
    assert claim.kind == "ok" and claim.state is not None
    assert claim.state.status is AgentStatus.NEEDS_MODEL
    await store.release(0, token)
    return claim.state


async def _resend(store: BatchStore, state: AgentState) -> int:
    return await store.resend(state, [(QUEUE, "re-sent")], recheck_ms=1000, max_resends=5)


async def test_a_started_model_turn_re_sent_is_counted_once_per_started_run(
        redis_client: Any) -> None:
    store = await _store(redis_client, "model")
    state = await _died_holding(store)
    assert await _resend(store, state) == 1
    assert await _count(redis_client, store) == 1
    assert await redis_client.hget(store.k.meta, "stat:recovered") == "1"
    # re-sent again with nobody having started it since (its message was lost): no new run
    assert await _resend(store, state) == 2
    assert await _count(redis_client, store) == 1
    # a second worker starts it and dies too: that run may have paid as well
    state = await _died_holding(store)
    assert await _resend(store, state) == 3
    assert await _count(redis_client, store) == 2


async def test_a_re_sent_tool_round_is_not_a_model_request(redis_client: Any) -> None:
    store = await _store(redis_client, "tools")
    state = await _died_holding(store)
    tools = state.model_copy(update={"status": AgentStatus.AWAITING_TOOLS})
    assert await _resend(store, tools) == 1
    assert await _count(redis_client, store) == 0
    assert await redis_client.hget(store.k.meta, "stat:recovered") == "1"


async def test_a_turn_in_a_provider_batch_is_adopted_not_counted(redis_client: Any) -> None:
    store = await _store(redis_client, "pbatch")
    state = await _died_holding(store)
    await redis_client.hset(store.k.provider_batches, record_field(0, 0), "batch_1")
    assert await _resend(store, state) == 1
    assert await _count(redis_client, store) == 0


async def test_a_hedge_intent_is_counted_there_not_twice(redis_client: Any) -> None:
    store = await _store(redis_client, "hedge")
    token = uuid.uuid4().hex
    claim = await store.claim_turn(0, 0, token, 30_000)
    assert claim.state is not None
    await ProviderBatches.hedge_intent(store, 0, 0, token)
    await store.release(0, token)
    assert await _resend(store, claim.state) == 1
    assert await _count(redis_client, store, "stat:hedge_sync_paid_unknown") == 1
    assert await _count(redis_client, store) == 0


# -- end to end: a real worker SIGKILLed with its sync request held by the simulator --------

N = 6
HOLD = "\n@sim fail timeout times=1"  # agent 0's first request is held far past the test
WAIT_S = 180.0


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, timeout_hold_s=900.0)) as server:
        yield server


def _requests(sim: SimServer) -> int:
    return int(sim.state.stats.requests["chat_completions"])


@pytest.mark.slow
def test_a_worker_killed_during_a_sync_turn_leaves_it_counted(
        sim: SimServer, redis_url: str, start_workers) -> None:
    [first] = start_workers(1, concurrency=8)
    inputs = [{"i": i, "hold": HOLD if i == 0 else ""} for i in range(N)]
    handle = submit_batch("Agent {i}.{hold}", inputs, model="sim-model",
                          backend=sim_url(sim), output_schema=Answer,
                          warm_prefix=False, max_turns=2, redis_url=redis_url)

    def read() -> tuple[int, int]:
        return handle.progress().done, _requests(sim)

    # the other agents are done and agent 0's request reached the simulator
    poll_until(read, lambda seen: seen == (N - 1, N), lambda seen: f"not held yet: {seen}",
               timeout=90)
    first.kill()  # SIGKILL: agent 0's request is in flight, billed by the provider
    [second] = start_workers(1, concurrency=8)  # its sweep re-sends agent 0's turn

    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    counts = handle.status()
    assert _requests(sim) == N + 1  # agent 0's turn was sent twice
    assert counts.get(STAT, 0) == 1, counts
    assert counts["stat:recovered"] >= 1
    assert counts.get("stat:hedge_sync_paid_unknown", 0) == 0
    logged = second.log_path.read_text(errors="replace")
    assert f"batch {handle.batch_id}: agent 0 v" in logged, logged[-2000:]
    assert STAT in logged

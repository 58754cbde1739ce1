"""Budget caps on the distributed engine, fleet-wide: the batch's spend is kept in Redis (meta's
``spend``), added by the commit script only when its compare-and-set wins, so a turn that
runs twice is paid into it once; a claim reads it, and at ``max_cost_usd`` (or an agent at
``max_agent_cost_usd``) no new turn starts on any worker and the agent ends
``budget_exceeded``. ``progress().cost_usd`` is that live spend. Real redis-server, real
``agentbatch worker`` processes, real HTTP to the simulator."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.core.agent_state import AgentState
from agentbatch.core.model_io import Usage
from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.progress import DistributedProgress
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import BatchStore, state_entry, stored_state
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.transition import Transition
from tests.support.tools import Answer, lookup

MODEL = "sim-model"
PRICES = {MODEL: {"prompt": 3.0, "cached_prompt": 0.3, "completion": 15.0}}
TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
WAIT_S = 180.0


def _run(redis_url: str, sim_url: str, n: int, **opts: Any):
    handle = submit_batch(TASK, [{"i": i} for i in range(n)], model=MODEL, backend=sim_url,
                          tools=[lookup], output_schema=Answer, prices=PRICES,
                          warm_prefix=False, redis_url=redis_url, **opts)
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == n
    return handle, results


def _meta(redis_url: str, batch_id: str) -> dict[str, str]:
    client = redis.from_url(redis_url, decode_responses=True)
    try:
        return client.hgetall(BatchKeys(batch_id).meta)
    finally:
        client.close()


def _chat_requests(sim) -> int:
    return sim.state.stats.as_dict()["requests_total"]


@pytest.mark.redis
@pytest.mark.slow
def test_spend_in_redis_is_the_sum_of_the_results_costs(redis_url, sim_url,
                                                        start_workers) -> None:
    start_workers(2, concurrency=4)
    handle, results = _run(redis_url, sim_url, 12, max_cost_usd=1000.0)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    total = sum(r.cost_usd for r in results)
    meta = _meta(redis_url, handle.batch_id)
    assert float(meta["spend"]) == pytest.approx(total, rel=1e-9)
    assert int(meta["replies"]) == sum(r.turns for r in results) == 24
    progress = handle.progress()
    assert progress.cost_usd == pytest.approx(total, rel=1e-9)
    assert progress.projected_cost_usd == pytest.approx(progress.cost_usd)  # nothing left
    assert progress.budget_warning is None


@pytest.mark.redis
@pytest.mark.slow
def test_max_agent_cost_ends_each_agent_after_the_turn_that_reached_it(
        redis_url, sim, sim_url, start_workers) -> None:
    start_workers(2, concurrency=4)
    cap = 1e-9  # any one turn passes it: the first turn runs, the second never starts
    handle, results = _run(redis_url, sim_url, 6, max_agent_cost_usd=cap)
    assert [r.error.kind if r.error else None for r in results] == ["budget_exceeded"] * 6
    assert all("max_agent_cost_usd=1e-09 reached" in r.error.message for r in results)
    assert all(r.turns == 1 and r.cost_usd >= cap for r in results)
    assert _chat_requests(sim) == 6  # one model call per agent, none after its cap
    assert float(_meta(redis_url, handle.batch_id)["spend"]) == pytest.approx(
        sum(r.cost_usd for r in results), rel=1e-9)


@pytest.mark.redis
@pytest.mark.slow
def test_max_cost_stops_new_turns_fleet_wide(redis_url, sim, sim_url, start_workers) -> None:
    per_worker = 2
    workers = start_workers(2, concurrency=per_worker)
    _, free = _run(redis_url, sim_url, 4)
    assert all(r.ok for r in free)
    per_turn = 1.5 * max(r.cost_usd for r in free)  # bounds any one turn's cost, with room
    cap = 3 * max(r.cost_usd for r in free)  # about a quarter of the 12 agents' spend
    before = _chat_requests(sim)
    handle, results = _run(redis_url, sim_url, 12, max_cost_usd=cap, max_inflight=2)
    spent = sum(r.cost_usd for r in results)
    kinds = [r.error.kind for r in results if not r.ok]
    assert set(kinds) == {"budget_exceeded"}, kinds
    assert kinds.count("budget_exceeded") >= 4, kinds
    assert all(f"max_cost_usd={cap:g} reached" in r.error.message for r in results if not r.ok)
    assert spent >= cap  # the cap was reached before any agent was stopped
    # a turn claimed before the cap was reached still runs: at most one per worker thread
    in_flight = len(workers) * per_worker
    assert spent <= cap + in_flight * per_turn
    assert _chat_requests(sim) - before == sum(r.turns for r in results)
    meta = _meta(redis_url, handle.batch_id)
    assert float(meta["spend"]) == pytest.approx(spent, rel=1e-9)
    progress = handle.progress()
    assert progress.cost_usd == pytest.approx(spent, rel=1e-9)
    assert progress.failed_by_kind == {"budget_exceeded": len(kinds)}
    assert spent > cap and progress.budget_warning is not None
    assert "passes max_cost_usd" in progress.budget_warning


@pytest.mark.redis
def test_caps_are_accepted_by_the_distributed_engine(redis_url, sim_url) -> None:
    # before: BatchSpecError "max_cost_usd: embedded-only for now"
    handle = submit_batch(TASK, [{"i": 0}], model=MODEL, backend=sim_url, tools=[lookup],
                          prices=PRICES, max_cost_usd=1.0, max_agent_cost_usd=0.5,
                          redis_url=redis_url)
    plan = BatchPlan.model_validate_json(
        redis.from_url(redis_url).get(BatchKeys(handle.batch_id).plan))
    assert (plan.max_cost_usd, plan.max_agent_cost_usd) == (1.0, 0.5)
    handle.cancel()


BATCH = "spend-once"


async def _twice(redis_url: str) -> dict[str, Any]:
    """One turn committed by two deliveries of the same version: the loser adds nothing."""
    client = async_client(redis_url)
    try:
        store = BatchStore(client, Scripts(client), BATCH)
        state = AgentState(index=0, input={})
        await client.hset(store.k.state, "0", state_entry(0, stored_state(state)))
        await client.hset(store.k.meta, mapping={"total": 1, "created_at": 1.0})
        seen: dict[str, Any] = {}
        token = uuid.uuid4().hex
        claim = await store.claim_turn(0, 0, token, 30_000)
        assert claim.kind == "ok" and claim.state is not None
        seen["spent before"] = claim.spent_usd
        new = claim.state.model_copy(update={
            "version": 1, "turns": 1, "steps": 1,
            "usage": Usage(prompt_tokens=1000, completion_tokens=100)})
        seen["first"] = await store.commit(Transition(claim.state, new, token=token,
                                                      deadline_ms=1, spend_usd=0.0045))
        # the same turn, run again by a second delivery that loaded version 0 too
        seen["second"] = await store.commit(Transition(claim.state, new, token="other",
                                                       deadline_ms=1, spend_usd=0.0045))
        seen["meta"] = await client.hgetall(store.k.meta)
        again = await store.claim_turn(0, 1, uuid.uuid4().hex, 30_000)
        seen["claimed spend"] = again.spent_usd
        return seen
    finally:
        await client.aclose()


@pytest.mark.redis
def test_a_turn_committed_twice_is_paid_into_the_spend_once(redis_url) -> None:
    seen = asyncio.run(_twice(redis_url))
    assert seen["spent before"] == 0.0
    assert (seen["first"], seen["second"]) == (True, False)
    assert float(seen["meta"]["spend"]) == pytest.approx(0.0045, rel=1e-12)
    assert seen["meta"]["replies"] == "1"
    assert seen["claimed spend"] == pytest.approx(0.0045, rel=1e-12)
    # progress reads the live spend: no agent has finished, no result holds a cost yet
    client = redis.from_url(redis_url, decode_responses=True)
    keys = BatchKeys(BATCH)
    client.set(keys.plan, BatchPlan(batch_id=BATCH, total=1, model=MODEL,
                                    backends=["sim://127.0.0.1:1"], system_message="s",
                                    prices=PRICES, max_cost_usd=0.001).model_dump_json())
    progress = DistributedProgress(client, BATCH, 1, lambda: 0).snapshot(
        lambda: client.hgetall(keys.meta))
    assert progress.done == 0 and progress.cost_usd == pytest.approx(0.0045, rel=1e-12)
    # one reply so far at 0.0045, one agent left for max_turns more: past the 0.001 cap
    assert progress.projected_cost_usd is not None and progress.projected_cost_usd > 0.0045
    assert progress.budget_warning is not None and "max_cost_usd=0.001" in \
        progress.budget_warning
    client.close()

"""Provider batch latencies shared by the fleet (``distributed/provider_batches.py``): what one
worker observed when its provider batches ended is in the batch's keys, and a worker that
builds its router for the batch afterwards (one joining mid-batch) starts from it. Two
``ProviderBatches`` (two workers' provider-batch sides) on a real redis-server; the test
asserts what the second one read and decided, never timings."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentbatch.core.agent_state import AgentState
from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.provider_batches import (
    SHARED_LATENCIES,
    ProviderBatches,
    _Submitted,
    latency_key,
    redis_clock,
)
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.redis_store import BatchStore, sync_clock
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.workers.batch_stats import BatchStats

pytestmark = [pytest.mark.redis]

SEEN_S = 30.0  # what the first worker's provider batches took
SIZE = 4


async def _note(batch_id: str, what: str, n: int = 1) -> None:
    return None


def _worker(client: Any) -> ProviderBatches:
    return ProviderBatches(_note, BatchStats(client, Scripts(client), flush_s=3600))


async def _first_worker_saw(first: ProviderBatches, store: BatchStore, n: int) -> None:
    """``n`` provider batches of ``SIZE`` turns of the batch, submitted ``SEEN_S`` ago,
    ended at the first worker (its poller's bookkeeping, as after a real submit)."""
    for i in range(n):
        pb = f"pb-{i}"
        first._submitted[pb] = _Submitted(redis_clock() - SEEN_S, SIZE)
        first._owners[pb] = {store.batch_id: store}
        await first._observe(pb)


def _plan(batch_id: str, pricing: str, deadline_s: float | None) -> BatchPlan:
    return BatchPlan(batch_id=batch_id, total=100, model="m", backends=["sim://127.0.0.1:1"],
                     system_message="", max_turns=3, pricing=pricing,
                     deadline_at=None if deadline_s is None else redis_clock() + deadline_s)


def test_a_worker_joining_mid_batch_hedges_on_the_fleets_latencies(redis_url: str) -> None:
    async def scenario() -> tuple[float | None, float | None, int]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        store = BatchStore(client, Scripts(client), "joined")
        plan = _plan("joined", "batch", None)  # no deadline: hedged past the p90
        first = _worker(client)
        await first.router_for(plan, store)
        await _first_worker_saw(first, store, 5)
        second = _worker(client)
        router = await second.router_for(plan, store)  # the second worker's first turn
        submitted = redis_clock()
        at = router.hedge_at(submitted, 1.0, SIZE)
        alone = _worker(client).router(plan).hedge_at(submitted, 1.0, SIZE)  # blind
        await client.aclose()
        return None if at is None else at - submitted, alone, \
            router.stats["batch_latencies_shared_read"]

    after, alone, read = asyncio.run(scenario())
    assert read == 5
    assert alone is None  # a router of its own only: no p90 to hedge on yet
    assert after == pytest.approx(SEEN_S, abs=1.0)  # the fleet's p90 (each took SEEN_S)


def test_a_worker_joining_mid_batch_routes_on_the_fleets_latencies(redis_url: str) -> None:
    async def scenario() -> tuple[str, str, list[float]]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        store = BatchStore(client, Scripts(client), "routed")
        await client.hset(store.k.meta, mapping={"total": 100, "delivered": 0})
        # 20 s left: a turn at the fleet's 30 s p90 would miss it; on no latency it fits
        plan = _plan("routed", "auto", 20.0)
        first = _worker(client)
        await _first_worker_saw(first, store, 3)
        state = AgentState(index=0, input={}, turns=2)  # its last (estimated) turn

        async def first_routed(worker: ProviderBatches) -> str:
            router = await worker.router_for(plan, store)
            with router.timed_sync():  # its probe has answered: routing is on latencies
                pass
            return await worker.route(plan, store, state)

        joined = await first_routed(_worker(client))
        seen = sorted(_worker(client).router(plan).batch_latency.samples)
        await client.delete(latency_key(store))  # the same, with nothing shared
        blind = await first_routed(_worker(client))
        await client.aclose()
        return joined, blind, seen

    joined, blind, seen = asyncio.run(scenario())
    assert seen == []  # ``router`` alone reads nothing: ``router_for`` does
    assert joined == "sync"  # the fleet's batches take 30 s: the deadline needs the sync API
    assert blind == "batch"  # without them, the worker would have sent it to a batch


def test_the_shared_latencies_are_capped_and_expire_with_the_batch(redis_url: str) -> None:
    async def scenario() -> tuple[int, int]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        store = BatchStore(client, Scripts(client), "capped")
        first = _worker(client)
        await _first_worker_saw(first, store, SHARED_LATENCIES + 5)
        length = await client.llen(latency_key(store))
        ttl = await client.pttl(latency_key(store))
        await client.aclose()
        return length, ttl

    length, ttl = asyncio.run(scenario())
    assert length == SHARED_LATENCIES
    assert ttl > 0


@pytest.mark.slow
def test_real_workers_share_the_latencies_of_the_provider_batches_that_ended(
        redis_url: str, start_workers: Any) -> None:
    import redis as sync_redis

    from agentbatch import submit_batch
    from agentbatch.distributed.state.keys import BatchKeys
    from tests.support.provider_batch import MODEL, PRICES, batch_sim, jobs, sim_url
    from tests.support.tools import Answer, lookup

    for sim in batch_sim(0.5):
        start_workers(1, concurrency=8)
        handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                              [{"i": i} for i in range(4)], model=MODEL, backend=sim_url(sim),
                              tools=[lookup], output_schema=Answer, prices=PRICES,
                              warm_prefix=False, max_turns=3, redis_url=redis_url,
                              pricing="batch")
        results = handle.wait(timeout=180)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        client = sync_redis.from_url(redis_url, decode_responses=True)
        key = f"{BatchKeys(handle.batch_id).provider_batches}:latency"
        shared = client.lrange(key, 0, -1)
        client.close()
        # one entry per provider batch the worker saw end, "<seconds>:<turns>" (one a hedge
        # answered in full before its poll saw it end is cancelled, not measured)
        assert 1 <= len(shared) <= len(jobs(sim)), shared
        sizes = {len(job.items) for job in jobs(sim)}
        assert {int(entry.split(":")[1]) for entry in shared} <= sizes, shared
        assert all(float(entry.split(":")[0]) >= 0.5 for entry in shared), shared


def test_a_workers_router_routes_at_the_batchs_price_ratio(redis_url: str) -> None:
    """The routing quantile comes from the plan's price table on a worker too (the batch
    price over the sync price, ``batch_routing.route_q_for``), half without one."""
    async def scenario() -> tuple[float, float]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        dear = _plan("dear", "auto", 600.0).model_copy(update={"prices": {"m": {
            "prompt": 1.0, "completion": 2.0, "batch_prompt": 0.8, "batch_completion": 1.2}}})
        plain = _plan("plain", "auto", 600.0)
        worker = _worker(client)
        try:
            return worker.router(dear).route_q, worker.router(plain).route_q
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == (0.8, 0.5)

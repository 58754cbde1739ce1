"""pricing="auto" and deadline= on the distributed engine: each worker routes every turn with
the router the embedded engine uses (turnloop/batch_routing.py), hedges a turn waiting in a
provider batch to the sync API at the router's hedge time, and commits the first answer once
through the versioned compare-and-set. Real redis-server, real ``agentbatch worker``
processes, the simulator serving the OpenAI batch API over real HTTP. The tests assert what
agentbatch decided (the batch's stats, the sim's request counts), never timings."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis

from agentbatch import BatchSpecError, submit_batch
from agentbatch.core.pricing import cost_usd
from agentbatch.distributed.provider_batches import SUBMITTING
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import MODEL, PRICES, chat_only, chat_requests
from tests.support.provider_batch import batch_sim as _sim
from tests.support.provider_batch import jobs as _jobs
from tests.support.provider_batch import sim_url as _url
from tests.support.tools import Answer, lookup

TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
N = 6
WAIT_S = 180.0  # generous: the machine is shared
SYNC_ROUTES = ("stat:routed_sync_probe", "stat:routed_sync_tail", "stat:routed_sync_deadline")


def _submit(redis_url: str, sim: SimServer, **opts: Any):
    return submit_batch(TASK, [{"i": i} for i in range(N)], model=MODEL, backend=_url(sim),
                        tools=[lookup], output_schema=Answer, prices=PRICES,
                        warm_prefix=False, max_turns=3, redis_url=redis_url, **opts)


def _finish(handle):
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert [r.turns for r in results] == [2] * N  # each turn applied exactly once
    return results


def _provider_saw_what_was_counted(sim: SimServer, stats: dict[str, Any]) -> None:
    jobs = _jobs(sim)
    assert len(jobs) == stats.get("stat:provider_batches", 0)
    assert sum(len(job.items) for job in jobs) == stats.get("stat:provider_batch_items", 0)


@pytest.mark.redis
@pytest.mark.slow
def test_auto_routes_turns_to_both_apis_and_meets_a_deadline_all_batch_would_miss(
        redis_url, start_workers) -> None:
    # two turns of a 6 s batch latency each: all-batch would take > 12 s
    for sim in _sim(6.0):
        start_workers(2, concurrency=8)
        handle = _submit(redis_url, sim, pricing="auto", deadline=12.0)
        results = _finish(handle)
        stats = handle.status()
        routed_sync = sum(stats.get(k, 0) for k in SYNC_ROUTES)
        assert routed_sync >= 1  # each worker's first routed turn is its probe, at least
        assert stats.get("stat:provider_batch_items", 0) >= 1  # and some went to the batch API
        _provider_saw_what_was_counted(sim, stats)
        # the sync API answered the turns routed to it and the hedges that won, no more
        assert chat_requests(sim) == routed_sync + stats.get("stat:hedge_won_by_sync", 0) \
            + stats.get("stat:provider_batch_fallback_sync", 0)
        # each reply priced at the API that gave it: batch-served turns at the batch rates
        batch_served = [r for r in results
                        if r.cost_usd < cost_usd(r.usage, PRICES[MODEL]) - 1e-12]
        sync_only = [r for r in results if r.cost_usd == pytest.approx(
            cost_usd(r.usage, PRICES[MODEL]))]
        assert len(batch_served) + len(sync_only) == N


@pytest.mark.redis
@pytest.mark.slow
def test_a_batch_turn_waiting_past_its_hedge_time_is_hedged_and_committed_once(
        redis_url, start_workers) -> None:
    # the provider batches never answer within the test: every turn must be hedged
    for sim in _sim(600.0):
        start_workers(1, concurrency=8)
        handle = _submit(redis_url, sim, pricing="batch", deadline=10.0)
        results = _finish(handle)
        stats = handle.status()
        # every turn hedged, and won by the sync API (a turn re-sent while live on a loaded
        # machine may race twice: its second commit loses the compare-and-set)
        assert stats["stat:batch_hedged"] == stats["stat:hedge_won_by_sync"] >= 2 * N
        assert "stat:hedge_won_by_batch" not in stats
        assert chat_requests(sim) == stats["stat:hedge_won_by_sync"]
        for r in results:  # every reply came from the sync API, priced so
            assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL]))
        _provider_saw_what_was_counted(sim, stats)
        # a provider batch whose turns the sync API all answered is cancelled at the provider
        jobs = _jobs(sim)
        stop = time.monotonic() + 60  # the next poll of each notices
        while any(job.cancelled is None for job in jobs) and time.monotonic() < stop:
            time.sleep(0.1)
        assert all(job.cancelled is not None for job in jobs)
        assert handle.status().get("stat:provider_batches_cancelled", 0) == len(jobs)
        client = redis.from_url(redis_url)
        assert client.hlen(BatchKeys(handle.batch_id).provider_batches) == 0
        client.close()


def _wait_for_records(redis_url: str, batch_id: str) -> dict[str, str]:
    client = redis.from_url(redis_url, decode_responses=True)
    key = BatchKeys(batch_id).provider_batches
    stop = time.monotonic() + 60
    try:
        while time.monotonic() < stop:
            found = client.hgetall(key)
            if found and SUBMITTING not in found.values():
                return found
            time.sleep(0.02)
    finally:
        client.close()
    raise AssertionError("no provider batch recorded")


@pytest.mark.redis
@pytest.mark.slow
def test_a_worker_killed_while_auto_has_provider_batches_out_loses_nothing_silently(
        redis_url, start_workers) -> None:
    for sim in _sim(5.0):
        [first] = start_workers(1, concurrency=8)  # it claims every first turn
        handle = _submit(redis_url, sim, pricing="auto", deadline=60.0)
        records = _wait_for_records(redis_url, handle.batch_id)
        first.kill()  # SIGKILL, its provider batches still open at the provider
        jobs = _jobs(sim)
        assert set(records.values()) <= {job.id for job in jobs}
        start_workers(1, concurrency=8)  # its sweep re-sends the turns
        _finish(handle)
        stats = handle.status()
        # everything the provider was sent is counted; a turn submitted twice is reported
        _provider_saw_what_was_counted(sim, stats)
        items = sum(len(job.items) for job in _jobs(sim))
        adopted = stats.get("stat:provider_batch_adopted", 0)
        resubmitted = stats.get("stat:provider_batch_resubmitted", 0)
        assert adopted >= 1  # the re-sent turns waited on the recorded provider batches
        assert items <= 2 * N + resubmitted  # no turn paid twice at the provider unreported


@pytest.mark.redis
@pytest.mark.parametrize("deadline", [-5.0, "past"])
def test_a_deadline_in_the_past_is_refused_with_redis_url_before_anything_is_enqueued(
        redis_url, deadline) -> None:
    if deadline == "past":
        deadline = datetime.now(timezone.utc) - timedelta(minutes=1)
    for sim in _sim(1.0):
        with pytest.raises(BatchSpecError, match="deadline is in the past"):
            _submit(redis_url, sim, pricing="auto", deadline=deadline)
        assert redis.from_url(redis_url).dbsize() == 0
        assert chat_requests(sim) == 0 and not _jobs(sim)


@pytest.mark.redis
def test_auto_on_a_backend_without_a_batch_api_is_refused_before_anything_is_enqueued(
        redis_url) -> None:

    from tests.support.http_server import ThreadedServer

    with ThreadedServer(chat_only) as server, pytest.raises(BatchSpecError) as err:
        submit_batch("hi {i}", [{"i": 0}], model=MODEL, warm_prefix=False, prices=PRICES,
                     backend=f"sim://127.0.0.1:{server.port}", pricing="auto", deadline=600,
                     redis_url=redis_url)
    assert "pricing='auto'" in str(err.value) and "no provider batch API" in str(err.value)
    assert redis.from_url(redis_url).dbsize() == 0


@pytest.mark.redis
@pytest.mark.slow
def test_failed_provider_batch_items_go_to_the_sync_api_while_the_deadline_allows(
        redis_url, start_workers) -> None:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.3, batch_latency_spread=0.0,
                             batch_failure_rate=1.0)) as sim:
        start_workers(1, concurrency=8)
        handle = _submit(redis_url, sim, pricing="batch", deadline=300.0)
        results = _finish(handle)
        stats = handle.status()
        # every item failed at the provider; each turn was answered once, by the sync API
        assert stats["stat:provider_batch_fallback_sync"] == 2 * N
        assert chat_requests(sim) == 2 * N
        assert "stat:batch_hedged" not in stats  # the deadline was far: no hedge was needed
        for r in results:
            assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL]))
        _provider_saw_what_was_counted(sim, stats)

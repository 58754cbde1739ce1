"""pricing="batch" on the distributed engine: each worker gathers the model turns it runs into
provider batches on the simulator's OpenAI batch API (real HTTP), records them in Redis, and
commits each answer through the versioned compare-and-set of a sync turn. A worker SIGKILLed
while its provider batch is outstanding loses nothing: the re-sent turns find the provider
batch in Redis and wait on it instead of paying for the turn again, and the submissions the
provider saw are the ones the batch's stats report. Real redis-server, real ``agentbatch
worker`` processes."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from agentbatch import BatchSpecError, submit_batch
from agentbatch.core.pricing import cost_usd
from agentbatch.distributed.provider_batches import SUBMITTING
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim import SimServer
from tests.support.provider_batch import MODEL, PRICES, chat_only, chat_requests
from tests.support.provider_batch import batch_sim as _sim
from tests.support.provider_batch import jobs as _jobs
from tests.support.provider_batch import sim_url as _url
from tests.support.tools import Answer, lookup

TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
N = 6
WAIT_S = 180.0  # generous: the machine is shared


@pytest.fixture
def fast_batches() -> Iterator[SimServer]:
    yield from _sim(0.3)


@pytest.fixture
def slow_batches() -> Iterator[SimServer]:
    # long enough that the worker is killed while its first provider batch is open
    yield from _sim(8.0)


def _submit(redis_url: str, sim: SimServer):
    return submit_batch(TASK, [{"i": i} for i in range(N)], model=MODEL, backend=_url(sim),
                        tools=[lookup], output_schema=Answer, prices=PRICES,
                        warm_prefix=False, max_turns=3, pricing="batch",
                        redis_url=redis_url)


def _finish(handle):
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return results


def _assert_all_batch(sim: SimServer, handle, results) -> dict[str, int]:
    stats = handle.status()
    jobs = _jobs(sim)
    assert chat_requests(sim) == 0  # no turn went through the sync API
    assert sum(r.turns for r in results) == 2 * N
    for r in results:
        assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL], batch=True))
        assert r.cost_usd < cost_usd(r.usage, PRICES[MODEL])
    # the provider saw exactly the submissions and items the batch reports
    assert len(jobs) == stats["stat:provider_batches"]
    assert sum(len(job.items) for job in jobs) == stats["stat:provider_batch_items"]
    assert handle.progress().cost_usd == pytest.approx(sum(r.cost_usd for r in results))
    return stats


@pytest.mark.redis
@pytest.mark.slow
def test_pricing_batch_sends_every_turn_through_provider_batches(
        redis_url, fast_batches, start_workers) -> None:
    start_workers(2, concurrency=8)
    handle = _submit(redis_url, fast_batches)
    results = _finish(handle)
    stats = _assert_all_batch(fast_batches, handle, results)
    assert stats["stat:provider_batch_items"] == 2 * N  # each turn submitted once
    assert "stat:provider_batch_resubmitted" not in stats
    assert "stat:provider_batch_fallback_sync" not in stats
    # the records of committed turns are dropped
    assert redis.from_url(redis_url).hlen(BatchKeys(handle.batch_id).provider_batches) == 0


def _wait_for_record(redis_url: str, batch_id: str) -> dict[str, str]:
    client = redis.from_url(redis_url, decode_responses=True)
    key = BatchKeys(batch_id).provider_batches
    stop = time.monotonic() + 60
    try:
        while time.monotonic() < stop:
            found = client.hgetall(key)
            if len(found) == N and SUBMITTING not in found.values():
                return found
            time.sleep(0.05)
    finally:
        client.close()
    raise AssertionError(f"no provider batch recorded for the {N} first turns")


@pytest.mark.redis
@pytest.mark.slow
def test_a_worker_killed_while_its_provider_batch_is_outstanding_loses_and_repays_nothing(
        redis_url, slow_batches, start_workers) -> None:
    [first] = start_workers(1, concurrency=8)  # it claims every first turn
    handle = _submit(redis_url, slow_batches)
    records = _wait_for_record(redis_url, handle.batch_id)
    first.kill()  # SIGKILL, its provider batch still open at the provider
    jobs = _jobs(slow_batches)
    now = time.monotonic()
    assert [job.ended_at(now) for job in jobs] == [None] * len(jobs)
    assert set(records.values()) <= {job.id for job in jobs}
    start_workers(1, concurrency=8)  # its sweep re-sends the turns; they adopt the batch
    results = _finish(handle)
    stats = _assert_all_batch(slow_batches, handle, results)
    assert stats["stat:provider_batch_items"] == 2 * N  # no turn was submitted twice
    assert "stat:provider_batch_resubmitted" not in stats
    assert stats["stat:provider_batch_adopted"] >= N  # every first turn waited on its record


@pytest.mark.redis
def test_pricing_batch_on_a_backend_without_a_batch_api_is_refused_at_submit(
        redis_url) -> None:

    from tests.support.http_server import ThreadedServer

    with ThreadedServer(chat_only) as server, pytest.raises(BatchSpecError) as err:
        submit_batch("hi {i}", [{"i": 0}], model=MODEL, warm_prefix=False, prices=PRICES,
                     backend=f"sim://127.0.0.1:{server.port}", pricing="batch",
                     redis_url=redis_url)
    assert "no provider batch API" in str(err.value)
    assert redis.from_url(redis_url).dbsize() == 0


@pytest.mark.redis
@pytest.mark.slow
def test_a_turn_whose_submit_was_cut_short_is_submitted_again_and_reported(
        redis_url, fast_batches, start_workers) -> None:
    handle = _submit(redis_url, fast_batches)  # no worker yet: nothing claimed
    # what a worker killed between recording the turn and the provider's answer leaves
    client = redis.from_url(redis_url)
    client.hset(BatchKeys(handle.batch_id).provider_batches, "0:0", SUBMITTING)
    client.close()
    start_workers(1, concurrency=8)
    results = _finish(handle)
    stats = _assert_all_batch(fast_batches, handle, results)
    # agent 0's first turn may have been paid for twice: submitted again, and said so
    assert stats["stat:provider_batch_resubmitted"] == 1
    assert "stat:provider_batch_adopted" not in stats


@pytest.mark.redis
@pytest.mark.slow
def test_cancelling_stops_turns_waiting_on_a_provider_batch(
        redis_url, start_workers) -> None:
    for sim in _sim(600.0):
        start_workers(1, concurrency=8)
        handle = _submit(redis_url, sim)
        _wait_for_record(redis_url, handle.batch_id)
        handle.cancel()
        results = handle.wait(timeout=WAIT_S)
        assert [r.error.kind if r.error else None for r in results] == ["cancelled"] * N, \
            [r.error for r in results][:2]
        assert chat_requests(sim) == 0
        # the provider batches nobody waits on any more are cancelled at the provider
        jobs = _jobs(sim)
        stop = time.monotonic() + 60  # the next poll of each notices
        while any(job.cancelled is None for job in jobs) and time.monotonic() < stop:
            time.sleep(0.1)
        assert jobs and all(job.cancelled is not None for job in jobs)
        assert handle.status()["stat:provider_batches_cancelled"] == len(jobs)

"""The sweep parks agents whose message waits in a queue list, and re-sends only the lost
ones once their list has moved past them (issue 26 item 5: at 10,000 agents the sweep
re-sent thousands of agents that were only queued on a starved low-priority list, and each
copy cost a claim dropped as stale).

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import SWEEP_LOCK, WATCH, BatchKeys, parked_key
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS
from agentbatch.distributed.workers.context import WorkerContext
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.distributed.workers.sweep import CLOCK_SLACK_MS, HOLD_SHARE, LISTS, sweep_once
from tests.support.tools import Answer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

GRACE_S = 1.0  # queue grace for the submitter and the workers: the sweep looks early and often


def _submit(redis_url: str, sim_url: str, n: int):
    return submit_batch("Agent {i}.", [{"i": i} for i in range(n)], model="sim-model",
                        output_schema=Answer, backend=sim_url, redis_url=redis_url)


def _queued_of(client: redis.Redis, batch_id: str) -> list[tuple[str, str]]:
    """(list key, message) of every queued inference message of ``batch_id``."""
    found = []
    for p in PRIORITY_STEPS:
        key = queue_key(INFERENCE_QUEUE, p)
        found += [(key, m) for m in client.lrange(key, 0, -1) if batch_id in m]
    return found


def _parked(client: redis.Redis, member: str) -> float | None:
    """When ``member`` was parked (ms), if it is."""
    for key in LISTS:
        score = client.zscore(parked_key(key), member)
        if score is not None:
            return score
    return None


def _redis_ms(client: redis.Redis) -> int:
    secs, micros = client.time()
    return int(secs) * 1000 + int(micros) // 1000


def test_an_agent_only_queued_is_parked_not_resent_however_long_it_waits(
        redis_url, sim_url, start_workers, monkeypatch):
    monkeypatch.setenv("AGENTBATCH_QUEUE_GRACE_S", str(GRACE_S))  # the first deadlines
    # Only a tools worker: it runs the sweep, and nothing consumes the inference queue.
    start_workers(1, queues="tools", concurrency=2,
                  env={"AGENTBATCH_QUEUE_GRACE_S": str(GRACE_S)})
    handle = _submit(redis_url, sim_url, 30)
    client = redis.from_url(redis_url, decode_responses=True)
    keys = BatchKeys(handle.batch_id)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            _parked(client, keys.member(i)) is not None for i in range(30)):
        time.sleep(0.2)
    assert all(_parked(client, keys.member(i)) is not None for i in range(30))
    # 15 graces: before the fix each was re-sent 3 graces after submit (a copy jumping the
    # queue, the original dropped later as stale); parked, they cost no look meanwhile, and
    # the backstop (10 graces) parks them again as their list has not moved
    watched_until = time.monotonic() + 15 * GRACE_S
    while time.monotonic() < watched_until:
        assert len(_queued_of(client, handle.batch_id)) == 30  # no copy pushed
        time.sleep(0.5)
    assert handle.status().get("stat:recovered", 0) == 0
    start_workers(1, queues="inference", concurrency=8,
                  env={"AGENTBATCH_QUEUE_GRACE_S": str(GRACE_S)})
    results = handle.wait(timeout=120)
    assert len(results) == 30 and all(r.ok for r in results)
    status = handle.status()
    assert status.get("stat:recovered", 0) == 0, status
    assert status.get("stat:dropped_stale", 0) == 0, status


def test_a_lost_message_is_resent_once_its_list_moves_past_it_and_the_queued_are_not(
        redis_url, sim_url, start_workers, monkeypatch):
    monkeypatch.setenv("AGENTBATCH_QUEUE_GRACE_S", str(GRACE_S))
    env = {"AGENTBATCH_QUEUE_GRACE_S": str(GRACE_S)}
    start_workers(1, queues="tools", concurrency=2, env=env)  # the sweep, no consumer yet
    client = redis.from_url(redis_url, decode_responses=True)
    early = _submit(redis_url, sim_url, 20)
    lost = _submit(redis_url, sim_url, 1)
    for key, message in _queued_of(client, lost.batch_id):  # as a worker that took it, died
        client.lrem(key, 0, message)
    member = BatchKeys(lost.batch_id).member(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _parked(client, member) is None:
        time.sleep(0.2)
    since = _parked(client, member)
    assert since is not None, "the lost agent was never parked (its list was busy)"
    # messages sent after it was parked: once the list has taken the early ones, its oldest
    # message was sent after the lost agent was parked, so the list has moved past it
    while _redis_ms(client) <= since + CLOCK_SLACK_MS + 200:
        time.sleep(0.1)
    late = _submit(redis_url, sim_url, 20)
    assert not _queued_of(client, lost.batch_id)
    start_workers(1, queues="inference", concurrency=4, env=env)
    for handle in (lost, early, late):
        results = handle.wait(timeout=120)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert lost.status().get("stat:recovered", 0) == 1
    # queued for many graces before any consumer came, never re-sent: parked, then woken
    # after a worker had claimed them
    for handle in (early, late):
        status = handle.status()
        assert status.get("stat:recovered", 0) == 0, status
        assert status.get("stat:dropped_stale", 0) == 0, status


def test_a_periodic_pass_keeps_the_fleet_from_sweeping_again_within_the_interval(redis_url):
    """Every worker tries a pass every interval; the lock a periodic pass keeps afterwards
    makes that one pass per interval for the fleet, not one per worker."""
    client = redis.from_url(redis_url, decode_responses=True)
    settings = WorkerSettings(redis_url=redis_url, sweep_interval_s=30.0)
    gone = BatchKeys("gone-batch").member(0)  # due, of a batch with no keys: a pass drops it

    async def passes() -> tuple[int, bool, bool]:
        first, second = WorkerContext(settings), WorkerContext(settings)
        try:
            await sweep_once(first, periodic=True)
            held_ms = await first.redis.pttl(SWEEP_LOCK)
            client.zadd(WATCH, {gone: 0})
            await sweep_once(second, periodic=True)  # another worker, the same interval
            swept_within = client.zscore(WATCH, gone) is None
            client.delete(SWEEP_LOCK)  # the interval is over
            await sweep_once(second)  # a one-off pass (the sweep task) drops its lock after
            return held_ms, swept_within, client.zscore(WATCH, gone) is None
        finally:
            await first.redis.aclose()
            await second.redis.aclose()

    held_ms, swept_within, swept_after = asyncio.run(passes())
    assert 0 < held_ms <= HOLD_SHARE * 30_000
    assert not swept_within and swept_after
    assert not client.exists(SWEEP_LOCK)

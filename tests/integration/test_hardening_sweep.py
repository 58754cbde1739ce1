"""The recovery sweep and the claim path under damage, load and overlap (issue 21, items 2,
3 and 8).

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP; the
overlapping-sweepers tests run two sweepers' passes in this process against the real server,
pausing one of them where a slow or paused process would be.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import SWEEP_LOCK, WATCH, BatchKeys, parked_key
from agentbatch.distributed.state.redis_store import BatchStore
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS
from agentbatch.distributed.workers.context import WorkerContext
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.distributed.workers.sweep import LISTS, sweep_once
from tests.support.tools import Answer

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _submit(redis_url: str, sim_url: str, n: int, **kw):
    return submit_batch("Agent {i}.", [{"i": i} for i in range(n)], model="sim-model",
                        output_schema=Answer, backend=sim_url, redis_url=redis_url, **kw)


def _damage(client: redis.Redis, batch_id: str, indices: range | list[int]) -> None:
    """Overwrite agents' state entries with JSON that does not parse, keeping the version."""
    keys = BatchKeys(batch_id)
    entries = client.hmget(keys.state, [str(i) for i in indices])
    client.hset(keys.state, mapping={str(i): e.partition(":")[0] + ':{"index": damaged'
                                     for i, e in zip(indices, entries, strict=True)})


def _messages_of(client: redis.Redis, batch_id: str) -> list[tuple[str, str]]:
    """(list key, message) of every queued inference message of ``batch_id``."""
    found = []
    for p in PRIORITY_STEPS:
        key = queue_key(INFERENCE_QUEUE, p)
        found += [(key, m) for m in client.lrange(key, 0, -1) if batch_id in m]
    return found


def _lose(client: redis.Redis, batch_id: str) -> None:
    """Delete ``batch_id``'s queued messages, as a worker that prefetched them and died."""
    for key, message in _messages_of(client, batch_id):
        client.lrem(key, 0, message)


# --- item 2: an agent whose state entry cannot be read --------------------------------------


def test_a_damaged_state_entry_ends_its_agent_as_internal(redis_url, sim_url, start_workers):
    handle = _submit(redis_url, sim_url, 3)
    client = redis.from_url(redis_url, decode_responses=True)
    _damage(client, handle.batch_id, [1])
    start_workers(1, concurrency=4)
    results = handle.wait(timeout=120)  # before the fix: never returned (TimeoutError)
    assert [r.ok for r in results] == [True, False, True], [r.error for r in results]
    error = results[1].error
    assert error.kind == "internal" and "stored state cannot be read" in error.message, error
    status = handle.status()
    assert status["finished"] == 1 and status.get("stat:damaged_state", 0) >= 1, status


def test_damaged_entries_due_in_the_watch_set_do_not_blind_the_sweep(redis_url, sim_url,
                                                                     start_workers):
    client = redis.from_url(redis_url, decode_responses=True)
    damaged = _submit(redis_url, sim_url, 600)  # more than one sweep pass looks at (500)
    _damage(client, damaged.batch_id, range(600))
    _lose(client, damaged.batch_id)  # only the sweep can find them now, due first of all
    keys = BatchKeys(damaged.batch_id)
    client.zadd(WATCH, {keys.member(i): 0 for i in range(600)}, xx=True)
    healthy = _submit(redis_url, sim_url, 1)
    _lose(client, healthy.batch_id)  # lost: only the sweep can re-send it
    start_workers(1, concurrency=4)
    results = healthy.wait(timeout=120)  # before the fix: never re-sent (TimeoutError)
    assert results[0].ok, results[0].error
    ended = damaged.wait(timeout=120)
    assert len(ended) == 600
    assert {r.error.kind for r in ended} == {"internal"}, {r.error.kind for r in ended}


# --- item 3: a lost, never-started message on a busy queue ----------------------------------


def test_a_lost_unstarted_message_is_resent_while_other_work_keeps_the_queue_busy(
        redis_url, sim_url, start_workers, monkeypatch):
    grace_s = 2.0
    monkeypatch.setenv("AGENTBATCH_QUEUE_GRACE_S", str(grace_s))  # the first deadlines
    env = {"AGENTBATCH_QUEUE_GRACE_S": str(grace_s)}
    client = redis.from_url(redis_url, decode_responses=True)
    # A tools worker runs the sweep; the inference queue is consumed by one slot only, so
    # the other batches' messages keep its list busy while it moves.
    start_workers(1, queues="tools", concurrency=2, env=env)
    busy = _submit(redis_url, sim_url, 50)
    lost = _submit(redis_url, sim_url, 1)
    _lose(client, lost.batch_id)
    member = BatchKeys(lost.batch_id).member(0)
    started = time.monotonic()
    deadline = started + 30 * grace_s
    while time.monotonic() < deadline and not any(
            client.zscore(parked_key(key), member) for key in LISTS):
        time.sleep(0.2)  # found due, its list busy: parked (sweep.py)
    more = _submit(redis_url, sim_url, 50)  # sent after it was parked
    start_workers(1, queues="inference", concurrency=1, env=env)
    while time.monotonic() < deadline and not _messages_of(client, lost.batch_id):
        if lost.status()["finished"]:
            break
        time.sleep(0.2)
    waited = time.monotonic() - started
    assert lost.wait(timeout=120)[0].ok, f"not re-sent within {waited:.1f} s"
    assert lost.status().get("stat:recovered", 0) == 1
    for handle in (busy, more):  # only queued: never re-sent
        assert all(r.ok for r in handle.wait(timeout=120))
        assert handle.status().get("stat:recovered", 0) == 0


# --- item 8: overlapping sweepers ----------------------------------------------------------


def _lost_agent(redis_url: str, sim_url: str) -> tuple[str, redis.Redis]:
    """A one-agent batch whose never-started message is lost and whose deadline is due,
    with both queues empty: the sweep must re-send it, once."""
    client = redis.from_url(redis_url, decode_responses=True)
    handle = _submit(redis_url, sim_url, 1)
    _lose(client, handle.batch_id)
    client.zadd(WATCH, {BatchKeys(handle.batch_id).member(0): 0}, xx=True)
    return handle.batch_id, client


async def _overlap(redis_url: str, while_paused) -> None:
    """Sweeper A's pass pauses just before its re-send; ``while_paused(b)`` runs meanwhile
    (with sweeper B's context), then A resumes."""
    settings = WorkerSettings(redis_url=redis_url, sweep_interval_s=0.5)
    a, b = WorkerContext(settings), WorkerContext(settings)
    reached, resume = asyncio.Event(), asyncio.Event()
    real = BatchStore.resend

    async def paused_resend(store: BatchStore, *args, **kwargs) -> int:
        if store.r is a.redis:
            reached.set()
            await asyncio.wait_for(resume.wait(), 120)
        return await real(store, *args, **kwargs)

    BatchStore.resend = paused_resend  # type: ignore[method-assign]
    try:
        pass_a = asyncio.create_task(sweep_once(a))
        await asyncio.wait_for(reached.wait(), 60)
        await while_paused(b)
        resume.set()
        await asyncio.wait_for(pass_a, 60)
    finally:
        BatchStore.resend = real  # type: ignore[method-assign]
        await a.redis.aclose()
        await b.redis.aclose()


def _assert_sent_once(client: redis.Redis, batch_id: str) -> None:
    sent = len(_messages_of(client, batch_id))
    resends = client.hget(BatchKeys(batch_id).resends, "0")
    recovered = client.hget(BatchKeys(batch_id).meta, "stat:recovered")
    assert (sent, resends, recovered) == (1, "0:1", "1"), (sent, resends, recovered)


def test_a_pass_longer_than_the_sweep_lock_keeps_it(redis_url, sim_url):
    batch_id, client = _lost_agent(redis_url, sim_url)

    async def sweep_past_the_lock_ttl(b: WorkerContext) -> None:
        # the lock's first TTL (5 s) runs out while A's pass is paused; B keeps trying
        ttl_ms = client.pttl(SWEEP_LOCK)
        assert ttl_ms > 0
        until = time.monotonic() + ttl_ms / 1000 + 3
        while time.monotonic() < until:
            await sweep_once(b)
            await asyncio.sleep(0.2)

    asyncio.run(_overlap(redis_url, sweep_past_the_lock_ttl))
    _assert_sent_once(client, batch_id)  # before the fix: B re-sent it too (2, "0:2", "2")


def test_a_sweeper_whose_lock_lapsed_sends_nothing_another_sent(redis_url, sim_url):
    batch_id, client = _lost_agent(redis_url, sim_url)

    async def lock_lapses_and_b_sweeps(b: WorkerContext) -> None:
        # A's whole process paused (its renewal too) past the lock: the lock is gone
        client.delete(SWEEP_LOCK)
        assert await sweep_once(b) == 1

    asyncio.run(_overlap(redis_url, lock_lapses_and_b_sweeps))
    _assert_sent_once(client, batch_id)  # before the fix: A re-sent it again (2, "0:2", "2")

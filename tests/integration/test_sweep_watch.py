"""The fleet-wide deadline zset: a sweep pass reads only the agents due, keeps the deadlines
of a batch still being submitted, and drops those of a batch whose keys are gone."""

from __future__ import annotations

import asyncio
import json

import redis

from agentbatch.distributed.state.keys import WATCH, BatchKeys
from agentbatch.distributed.state.queue_head import SENT_HEADER
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE
from agentbatch.distributed.workers.context import WorkerContext
from agentbatch.distributed.workers.envelope import queue_key
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.distributed.workers.sweep import sweep_once


def _sweep(redis_url: str) -> int:
    """One sweep pass by a worker context of its own; how many tasks it re-sent."""
    ctx = WorkerContext(WorkerSettings(redis_url=redis_url))

    async def sweep() -> int:
        try:
            return await sweep_once(ctx)
        finally:
            await ctx.redis.aclose()

    return asyncio.run(sweep())


def test_sweep_keeps_a_staging_batchs_deadlines_and_drops_a_gone_batchs(redis_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    staging, gone = BatchKeys("staging"), BatchKeys("gone")
    r.hset(staging.state, mapping={0: "0:{}", 1: "0:{}"})  # staged agents, no plan yet
    r.zadd(WATCH, {staging.member(0): 0, staging.member(1): 0, gone.member(0): 0,
                   gone.member(1): 0})
    assert _sweep(redis_url) == 0
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    assert set(scores) == {staging.member(0), staging.member(1)}  # the gone batch's dropped
    assert all(score > now_ms for score in scores.values())  # looked at again later


def test_with_both_queues_busy_unstarted_agents_are_let_wait_in_one_script_per_batch(
        redis_url: str) -> None:
    r = redis.from_url(redis_url, decode_responses=True)
    queued, gone = BatchKeys("queued2"), BatchKeys("gone2")  # gone2: no keys at all
    r.hset(queued.state, "0", "0:{}")  # its version is all the deferral reads
    r.zadd(WATCH, {queued.member(0): 0, gone.member(1): 0})  # neither marked started
    for queue in (INFERENCE_QUEUE, TOOLS_QUEUE):
        r.lpush(queue_key(queue, 9), "{}")  # messages waiting on both queues
    r.config_resetstat()
    assert _sweep(redis_url) == 0
    now_ms = int(r.time()[0]) * 1000
    scores = dict(r.zrange(WATCH, 0, -1, withscores=True))
    # the queued one was let wait without being inspected one by one, its version recorded;
    # the gone one (no state to defer) was looked at on its own and dropped with its batch
    assert set(scores) == {queued.member(0)}
    assert scores[queued.member(0)] > now_ms
    assert r.hget(queued.resends, "q:0").split(":")[0] == "0"
    calls = {k: v["calls"] for k, v in r.info("commandstats").items()}
    assert calls.get("cmdstat_zadd") == 1 and calls.get("cmdstat_zscore") is None, calls


def _head(r: redis.Redis, queue: str, sent_ms: int, message_id: str) -> None:
    """Make this the message at ``queue``'s consuming end (its only one)."""
    key = queue_key(queue, 0)
    r.delete(key)
    r.lpush(key, json.dumps({"headers": {SENT_HEADER: sent_ms, "id": message_id}}))


def test_an_unstarted_agent_waits_while_its_queue_moves_toward_it_and_not_once_past_it(
        redis_url: str) -> None:
    """A big batch queued longer than the queued-graces bound is not re-sent agent by agent
    while its queue works through it (issue 26 item 5: at 10,000 agents the sweep re-sent
    thousands of agents still queued, each then dropped as stale); a queue that stands
    still, or has moved past the agent, still gets it re-sent."""
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys("moving")
    r.hset(k.state, "0", "0:{}")  # never started, waiting for a turn (inference queue)
    r.zadd(WATCH, {k.member(0): 1000})  # its commit's deadline: sent at 1000 - grace
    _head(r, TOOLS_QUEUE, 1, "t")  # both queues busy
    _head(r, INFERENCE_QUEUE, 500, "a")  # sent before it: it is behind
    assert _sweep(redis_url) == 0
    assert r.hget(k.resends, "q:0") == "0:1000:a"  # first look: let wait, the head noted

    def look_again(sent_ms: int, message_id: str) -> str:
        r.zadd(WATCH, {k.member(0): 0}, xx=True)  # due again at the same version
        _head(r, INFERENCE_QUEUE, sent_ms, message_id)
        _sweep(redis_url)
        return r.hget(k.resends, "q:0")

    # the queue moved and its head was sent no later than a grace after the agent's message
    assert look_again(900, "b") == "0:1000:b"  # still behind: let wait again
    assert look_again(1000, "c") == "0:1000:c"
    # the queue stood still since the last look (the same head): not let wait (re-send)
    assert look_again(1000, "c") == "0:1000:c"
    assert r.zscore(WATCH, k.member(0)) is not None
    # the queue moved past it (its head sent after it): not let wait (re-send)
    assert look_again(1001, "d") == "0:1000:c"
    # a head without a sent stamp (a message from before it, or not ours): as a still queue
    r.hset(k.resends, "q:0", "0:1000:c")
    r.zadd(WATCH, {k.member(0): 0}, xx=True)
    r.delete(queue_key(INFERENCE_QUEUE, 0))
    r.lpush(queue_key(INFERENCE_QUEUE, 0), "{}")
    _sweep(redis_url)
    assert r.hget(k.resends, "q:0") == "0:1000:c"


def test_a_queue_whose_other_list_moves_is_moving_and_a_long_wait_is_looked_at_less_often(
        redis_url: str) -> None:
    """The sweep does not know which priority list holds the agent's message: a starved
    low-priority list that stands still does not make the queue look still while another
    list moves. An agent let wait again looks next after as long as it has waited."""
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys("starved")
    now_ms = int(r.time()[0]) * 1000
    grace_ms = WorkerSettings(redis_url=redis_url).queue_grace_ms
    first = now_ms - 100_000  # its message was sent 100 s + a grace ago
    r.hset(k.state, "0", "0:{}")
    r.zadd(WATCH, {k.member(0): first})
    _head(r, TOOLS_QUEUE, 1, "t")
    starved = queue_key(INFERENCE_QUEUE, 9)
    r.delete(starved)
    r.lpush(starved, json.dumps({"headers": {SENT_HEADER: first - grace_ms - 50_000,
                                             "id": "old"}}))
    _head(r, INFERENCE_QUEUE, first - grace_ms - 1_000, "a")
    assert _sweep(redis_url) == 0
    first_seen = r.hget(k.resends, "q:0")
    assert first_seen.startswith(f"0:{first}:")
    r.zadd(WATCH, {k.member(0): 0}, xx=True)
    _head(r, INFERENCE_QUEUE, first - grace_ms - 500, "b")  # moved; the starved list did not
    assert _sweep(redis_url) == 0
    seen = r.hget(k.resends, "q:0")
    assert seen.startswith(f"0:{first}:") and seen != first_seen, seen  # its new heads
    waited_ms = now_ms - (first - grace_ms)
    assert r.zscore(WATCH, k.member(0)) >= now_ms + waited_ms  # let wait again, for longer

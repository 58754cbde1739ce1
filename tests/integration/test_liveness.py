"""Liveness of the distributed engine: every fault ends in a result within a bound.

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP. Each test
reproduces one way the engine used to leave agents or whole batches stuck (issue 11).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest
import redis

from agentbatch import run_batch, submit_batch
from agentbatch.core.agent_state import AgentState
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import (
    BatchStore,
    entry_state,
    state_entry,
    stored_state,
)
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.transition import Transition
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS
from agentbatch.distributed.workers.envelope import queue_key
from tests.support.tools import Answer, Exploding, Renamed, lookup
from tests.support.waits import poll_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _submit(redis_url, sim_url, task, inputs, **kw):
    kw.setdefault("model", "sim-model")
    kw.setdefault("output_schema", Answer)
    kw.setdefault("backend", sim_url)
    return submit_batch(task, inputs, redis_url=redis_url, **kw)


def _queued(client: redis.Redis, queue: str) -> int:
    return sum(client.llen(queue_key(queue, p)) for p in PRIORITY_STEPS)


def _drop_queued(client: redis.Redis, queue: str) -> None:
    for p in PRIORITY_STEPS:
        client.delete(queue_key(queue, p))


def test_an_unloadable_batch_ends_and_never_stops_recovery_of_others(
        redis_url, sim_url, start_workers, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(sim_url + "\n")
    broken = _submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(5)],
                     backend=f"@{hostfile}", warm_prefix=False)
    hostfile.unlink()  # the workers cannot read it: the batch cannot be opened there
    # Three healthy batches whose turn messages were lost: only the sweep can recover them,
    # and it must, whichever order it visits the batches in.
    client = redis.from_url(redis_url)
    healthy = []
    for _ in range(3):
        healthy.append(_submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(4)]))
    # keep the broken batch's messages, lose the healthy ones': re-queue the broken ones
    broken_msgs = []
    for p in PRIORITY_STEPS:
        broken_msgs += [(queue_key(INFERENCE_QUEUE, p), m)
                        for m in client.lrange(queue_key(INFERENCE_QUEUE, p), 0, -1)
                        if broken.batch_id.encode() in m]
    _drop_queued(client, INFERENCE_QUEUE)
    for key, msg in broken_msgs:
        client.lpush(key, msg)
    start_workers(1, concurrency=8)
    results = broken.wait(timeout=60)
    assert len(results) == 5
    assert {r.error.kind for r in results} == {"config"}, [r.error for r in results]
    assert "hosts.txt" in results[0].error.message
    for handle in healthy:
        assert all(r.ok for r in handle.wait(timeout=60))


def test_an_exception_inside_step_ends_the_agent_as_internal(redis_url, sim_url,
                                                              start_workers):
    start_workers(1, concurrency=4)
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(3)],
                     output_schema=Exploding)
    results = handle.wait(timeout=60)
    assert [r.error.kind for r in results] == ["internal"] * 3, [r.error for r in results]
    assert "KeyError" in results[0].error.message
    status = handle.status()
    assert status.get("stat:recovered", 0) == 0, status  # ended, not re-sent by the sweep


def test_a_transforming_validator_runs_once(redis_url, sim_url, start_workers):
    task = 'Agent {i}.\n@sim answer {{"summary": "low{i}", "score": 1}}'
    start_workers(1, concurrency=4)
    results = _submit(redis_url, sim_url, task, [{"i": 0}, {"i": 1}],
                      output_schema=Renamed).wait(timeout=60)
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    assert isinstance(results[0].output, Renamed)
    assert [r.output.title for r in results] == ["LOW0", "LOW1"]
    embedded = run_batch(task, [{"i": 2}], model="sim-model", backend=sim_url,
                         output_schema=Renamed)
    assert embedded[0].ok and embedded[0].output.title == "LOW2", embedded[0].error


async def _commit_after_losing(redis_url: str, batch_id: str) -> tuple[bool, bool]:
    client = async_client(redis_url)
    try:
        store = BatchStore(client, Scripts(client), batch_id)
        token = uuid.uuid4().hex
        claim = await store.claim_turn(0, 0, token, 30_000)
        assert claim.kind == "ok"
        state: AgentState = claim.state
        # someone else moved the agent on meanwhile (e.g. a cancel or a re-sent duplicate)
        await client.hset(store.k.state, "0", state_entry(1, stored_state(state)))
        won = await store.commit(Transition(state, state.model_copy(update={"version": 1}),
                                             token=token))
        return won, bool(await client.exists(store.k.lease(0)))
    finally:
        await client.aclose()


def test_a_claimer_that_loses_the_compare_and_set_releases_its_lease(redis_url, sim_url):
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": 0}])
    won, leased = asyncio.run(_commit_after_losing(redis_url, handle.batch_id))
    assert not won
    assert not leased


def test_a_busy_claim_is_requeued_not_dropped(redis_url, sim_url, start_workers):
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": 0}])
    client = redis.from_url(redis_url)
    # a lease left by a worker that is still running this turn: kept alive (10 s to live,
    # renewed while it is still ours) until a claim has found it held and requeued the turn,
    # however long the worker takes to start; then left to run out
    lease = BatchKeys(handle.batch_id).lease(0)
    client.set(lease, "someone-else", px=10_000)
    renew = client.register_script(
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0")
    start_workers(1, concurrency=4, env={"AGENTBATCH_QUEUE_GRACE_S": "600"})

    def requeued() -> int:
        assert renew(keys=[lease], args=["someone-else", 10_000]) == 1, "the held lease lapsed"
        return int(handle.status().get("stat:requeued_busy", 0))

    poll_until(requeued, lambda n: n >= 1, lambda _: "no claim found the held lease in 120 s",
               timeout=120)
    results = handle.wait(timeout=60)  # far below the 600 s grace: no sweep needed
    assert results[0].ok, results[0].error


def test_the_sweep_does_not_resend_work_that_is_only_queued(redis_url, sim_url,
                                                           start_workers, monkeypatch):
    monkeypatch.setenv("AGENTBATCH_QUEUE_GRACE_S", "4")  # the submitter's first deadlines
    # Only a tools worker: it runs the sweep, nothing consumes the inference queue.
    start_workers(1, queues="tools", concurrency=2, env={"AGENTBATCH_QUEUE_GRACE_S": "4"})
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(200)])
    client = redis.from_url(redis_url)
    # 2 graces: the sweep's first look (at 1 grace) parks them: their list has not moved
    # (test_sweep_parking.py: not re-sent however long they wait)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        assert _queued(client, INFERENCE_QUEUE) == 200
        time.sleep(0.5)
    assert handle.status().get("stat:recovered", 0) == 0
    start_workers(1, queues="inference", concurrency=16)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results)
    stream = client.xlen(BatchKeys(handle.batch_id).results)
    assert stream == 200


def test_a_killed_tool_worker_is_recovered_at_lease_expiry_not_queue_grace(
        redis_url, sim_url, start_workers):
    # Defaults for grace (120 s); a 3 s lease. The tool runs 30 s; its worker is SIGKILLed.
    env = {"AGENTBATCH_QUEUE_GRACE_S": "120", "TEST_TOOL_SLEEP_S": "30"}
    start_workers(1, queues="inference", concurrency=4, env=env)
    [victim] = start_workers(1, queues="tools", concurrency=4, env=env)
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                     [{"i": 0}], tools=[lookup])
    client = redis.from_url(redis_url)
    deadline = time.monotonic() + 30
    while not client.get("test:exec:lookup:k0") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.get("test:exec:lookup:k0"), "the tool never started"
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    start_workers(1, queues="tools", concurrency=4, env={**env, "TEST_TOOL_SLEEP_S": "0.1"})
    seen_recovering = False
    for _ in range(200):
        status = handle.status()
        seen_recovering |= status.get("recovering", 0) > 0
        if status["finished"]:
            break
        time.sleep(0.1)
    results = handle.wait(timeout=40)  # lease 3 s: recovered in seconds, not 120 s
    assert results[0].ok, results[0].error
    assert int(client.get("test:exec:lookup:k0")) == 2
    assert handle.status().get("stat:recovered", 0) >= 1
    assert seen_recovering or handle.status().get("stat:recovered", 0) >= 1


async def _resends(redis_url: str, batch_id: str) -> list[int]:
    client = async_client(redis_url)
    try:
        store = BatchStore(client, Scripts(client), batch_id)
        state = entry_state(await client.hget(store.k.state, "0"))
        msg = [("test:resent", "m")]
        out = [await store.resend(state, msg, recheck_ms=1000, max_resends=3)
               for _ in range(4)]  # 1, 2, 3, then the cap: nothing sent
        await client.set(store.k.lease(0), "holder", px=5000)
        out.append(await store.resend(state, msg, recheck_ms=1000, max_resends=3))  # leased
        await client.delete(store.k.lease(0))
        # progress: a new version starts afresh
        await client.hset(store.k.state, "0", state_entry(1, stored_state(state)))
        out.append(await store.resend(state.model_copy(update={"version": 1}), msg,
                                      recheck_ms=1000, max_resends=3))
        out.append(await client.llen("test:resent"))
        return out
    finally:
        await client.aclose()


def test_resends_are_counted_per_version_capped_and_never_made_while_leased(redis_url,
                                                                            sim_url):
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": 0}], warm_prefix=False)
    assert asyncio.run(_resends(redis_url, handle.batch_id)) == [1, 2, 3, -2, -1, 1, 4]
    assert handle.status()["stat:recovered"] == 4  # counted only when sent

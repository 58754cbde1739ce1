"""A batch's plan and meta under damage and late control calls (issue 21, items 1 and 6).

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.core.errors import BatchExpired
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.retention import list_batches
from tests.support.tools import Answer, lookup

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TOOL_TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_a_worker_that_cannot_read_the_plan_never_finishes_the_batch_early(
        redis_url, sim_url, start_workers):
    # An inference worker runs every agent's first turn (each calls a slow tool), then goes;
    # while the tools run, the plan is rewritten as another version would write it and a new
    # inference worker starts: every turn after the tools lands on a worker that cannot read
    # the plan. Once the plan is readable again, the batch must end with all four results.
    env = {"TEST_TOOL_SLEEP_S": "3"}
    [first] = start_workers(1, queues="inference", concurrency=4, env=env)
    start_workers(1, queues="tools", concurrency=4, env=env)
    handle = submit_batch(TOOL_TASK, [{"i": i} for i in range(4)], backend=sim_url,
                          redis_url=redis_url, model="sim-model", output_schema=Answer,
                          tools=[lookup])
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(handle.batch_id)
    _wait_until(lambda: all(r.get(f"test:exec:lookup:k{i}") for i in range(4)), 90,
                "every agent's tool call to start")
    first.stop()
    good = r.get(k.plan)
    other_version = json.loads(good)
    other_version["backend_urls"] = other_version.pop("backends")
    r.set(k.plan, json.dumps(other_version))
    [blind] = start_workers(1, queues="inference", concurrency=4, env=env)
    _wait_until(lambda: "cannot read" in blind.log() or r.hget(k.meta, "finished") == "1",
                120, "the new worker to meet the unreadable plan")
    meta = r.hgetall(k.meta)
    ended = [json.loads(f["r"])["error"] for _, f in r.xrange(k.results)]
    assert meta.get("finished") != "1", (
        f"the batch was marked finished while no worker could run it: "
        f"{meta.get('delivered')} of {meta['total']} delivered, errors {ended}")
    assert not ended, ended  # the blind worker ended none of them
    r.set(k.plan, good)
    results = list(handle.results(timeout=120))
    assert len(results) == 4, [(x.index, x.error) for x in results]
    assert all(x.ok for x in results), [x.error for x in results]
    assert r.hget(k.meta, "delivered") == "4"


def test_cancel_after_expiry_raises_and_writes_nothing(redis_url, sim_url, start_workers,
                                                       monkeypatch):
    monkeypatch.setenv("AGENTBATCH_RETENTION_S", "2")
    start_workers(1, concurrency=4)
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(2)], backend=sim_url,
                          redis_url=redis_url, model="sim-model", output_schema=Answer)
    assert all(x.ok for x in handle.wait(timeout=120))
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(handle.batch_id)
    handle.cancel()  # finished, not yet expired: nothing to stop, and it stays "finished"
    assert r.hget(k.meta, "cancelled") == "0"
    assert [b.status for b in list_batches(r) if b.batch_id == handle.batch_id] == ["finished"]
    _wait_until(lambda: not r.exists(k.meta), 60, "the batch's retention to run out")
    with pytest.raises(BatchExpired, match=handle.batch_id):
        handle.cancel()
    assert not r.exists(k.meta), r.hgetall(k.meta)
    assert [b for b in list_batches(r) if b.batch_id == handle.batch_id] == []


def test_cancel_of_a_running_batch_marks_it(redis_url, sim_url):
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(2)], backend=sim_url,
                          redis_url=redis_url, model="sim-model", output_schema=Answer)
    handle.cancel()  # no worker yet: it stays queued, and is cancelling
    r = redis.from_url(redis_url, decode_responses=True)
    assert r.hget(BatchKeys(handle.batch_id).meta, "cancelled") == "1"
    assert [b.status for b in list_batches(r) if b.batch_id == handle.batch_id] == [
        "cancelling"]

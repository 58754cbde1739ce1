"""Follow-ups to issue 21's hardening: a plan no worker can read, a damaged state met by a
tool task.

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.state.keys import BatchKeys
from tests.support.tools import Answer

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_a_plan_no_worker_can_read_ends_its_agents_as_config(redis_url, sim_url,
                                                             start_workers):
    # Both batches are submitted before any worker starts; the first one's plan is then
    # rewritten as another version would write it, so every worker drops its tasks unclaimed.
    # With a re-send cap of 2, each of its agents must end `config` (the plan cannot be read)
    # once its re-sends are used up, while the other batch runs to the end.
    n = 4
    blind = submit_batch("Agent {i}.", [{"i": i} for i in range(n)], backend=sim_url,
                         redis_url=redis_url, model="sim-model", output_schema=Answer)
    other = submit_batch("Other {i}.", [{"i": i} for i in range(6)], backend=sim_url,
                         redis_url=redis_url, model="sim-model", output_schema=Answer)
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(blind.batch_id)
    plan = json.loads(r.get(k.plan))
    plan["backend_urls"] = plan.pop("backends")
    r.set(k.plan, json.dumps(plan))
    start_workers(2, concurrency=4, env={"AGENTBATCH_MAX_RESENDS": "2",
                                         "AGENTBATCH_QUEUE_GRACE_S": "2"})

    assert all(x.ok for x in other.wait(timeout=120))
    # bound: queue grace, then re-sends 1 and 2 leases apart (3 s leases), then the end;
    # a deadline of minutes leaves room for a loaded machine
    _wait_until(lambda: r.hget(k.meta, "delivered") == str(n) or r.hget(
        k.meta, "finished") == "1", 180, f"the {n} agents of the unreadable batch to end")
    results = list(blind.results(timeout=60))
    assert sorted(x.index for x in results) == list(range(n))
    assert [x.error.kind for x in results if x.error] == ["config"] * n, [
        x.error for x in results]
    assert all("cannot be read by this worker version" in x.error.message
               for x in results if x.error), results[0].error
    assert r.hget(k.meta, "finished") == "1"

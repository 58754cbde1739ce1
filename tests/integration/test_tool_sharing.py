"""Tool identity, sharing scope, unmerged side effects and fencing (issue 8, items 1-4).

Real redis-server, real `agentbatch worker` processes and the simulator over HTTP; the
embedded engine runs in this process. Tools count their executions in the test's Redis.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from agentbatch import AgentResult, Tool, submit_batch
from tests.support import tools_other
from tests.support.tools import Answer, fenced_pay, fleet_price, pay, price

pytestmark = [pytest.mark.redis, pytest.mark.slow]

Run = Callable[..., list[AgentResult]]
IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support,agentbatch.toolpool.builtins"}


@pytest.fixture(params=["distributed", "embedded"])
def run(request: pytest.FixtureRequest, redis_url: str, sim_url: str,
        monkeypatch: pytest.MonkeyPatch) -> Run:
    """Run a batch to the end on one engine (the tools count executions in Redis either way)."""
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)  # where embedded tools count
    if request.param == "distributed":
        request.getfixturevalue("start_workers")(1, concurrency=4, env=IMPORTS)

    def go(task: str, inputs: list[dict], tools: list[Tool]) -> list[AgentResult]:
        url = redis_url if request.param == "distributed" else None
        handle = submit_batch(task, inputs, tools=tools, backend=sim_url, model="sim-model",
                              output_schema=Answer, redis_url=url)
        results = handle.wait(timeout=120)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        return results

    return go


def _count(client: redis.Redis, key: str) -> int:
    return int(client.get(key) or 0)


def test_two_tools_named_price_never_share_results(run: Run, redis_url: str) -> None:
    item = uuid.uuid4().hex[:8]
    task = f'Agent {{i}}.\n@sim tool price {{{{"item": "{item}"}}}}'
    run(task, [{"i": 0}], [price])
    [b] = run(task, [{"i": 0}], [tools_other.price])
    client = redis.from_url(redis_url)
    assert _count(client, f"test:exec:price:a:{item}") == 1
    assert _count(client, f"test:exec:price:b:{item}") == 1  # B ran its own tool...
    assert not b.tool_calls[0].cached  # ...and was not served A's cached result


def test_cacheable_results_are_shared_within_a_batch_unless_the_tool_says_fleet(
        run: Run, redis_url: str) -> None:
    item = uuid.uuid4().hex[:8]
    task = (f'Agent {{i}}.\n@sim tool price {{{{"item": "{item}"}}}}\n'
            f'@sim tool fleet_price {{{{"item": "{item}"}}}}')
    for _ in range(2):  # two batches, three agents each, the same arguments everywhere
        run(task, [{"i": i} for i in range(3)], [price, fleet_price])
    client = redis.from_url(redis_url)
    assert _count(client, f"test:exec:price:a:{item}") == 2  # once per batch
    assert _count(client, f"test:exec:fleet_price:{item}") == 1  # once for the fleet


def test_a_plain_tool_runs_once_per_agent_call_with_its_own_key(
        run: Run, redis_url: str) -> None:
    invoice = uuid.uuid4().hex[:8]
    results = run(f'Agent {{i}}.\n@sim tool pay {{{{"invoice": "{invoice}"}}}}',
                  [{"i": 0}, {"i": 1}], [pay])
    keys = redis.from_url(redis_url, decode_responses=True).lrange(f"test:pay:{invoice}", 0, -1)
    assert len(keys) == 2 and len(set(keys)) == 2, keys  # two payments, two idempotency keys
    assert not any(c.coalesced or c.cached for r in results for c in r.tool_calls)


def _wait_for(predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_leader_paused_past_its_lock_is_fenced_off(
        redis_url: str, sim_url: str, start_workers) -> None:
    # One tool slot: while the paused worker holds the call it fetches nothing else, so the
    # re-sent call goes to the worker started afterwards.
    start_workers(1, queues="inference", concurrency=4, env=IMPORTS)
    start_workers(1, queues="tools", concurrency=1, env=IMPORTS)
    client = redis.from_url(redis_url, decode_responses=True)
    handle = submit_batch('Agent {i}.\n@sim tool fenced_pay {{"invoice": "inv"}}', [{"i": 0}],
                          tools=[fenced_pay], backend=sim_url, model="sim-model",
                          output_schema=Answer, redis_url=redis_url)
    _wait_for(lambda: client.llen("test:fenced:started:inv") == 1, "the tool to start")
    stale_pid = int(client.lindex("test:fenced:started:inv", 0).split(":")[0])
    os.kill(stale_pid, signal.SIGSTOP)  # the leader stalls past its 1 s lock (and lease)
    try:
        client.set("test:fenced:go:inv", 1)
        start_workers(1, queues="tools", concurrency=2, env=IMPORTS)
        [result] = handle.wait(timeout=120)  # the sweep re-sent the call; a new leader ran it
        assert result.ok, result.error
    finally:
        os.kill(stale_pid, signal.SIGCONT)
    _wait_for(lambda: client.llen("test:fenced:seen:inv") == 2, "the stale leader to finish")
    seen = [row.split(":") for row in client.lrange("test:fenced:seen:inv", 0, -1)]
    (new_pid, new_token, new_leader, new_wrote), (old_pid, old_token, old_leader, old_wrote) = seen
    assert int(old_pid) == stale_pid and int(new_pid) != stale_pid
    assert int(old_token) < int(new_token)  # the successor holds the higher fencing token
    assert (new_leader, new_wrote) == ("1", "1")
    assert (old_leader, old_wrote) == ("0", "0")  # still_leader() False, the write refused
    [key] = client.keys("test:fenced:effects:*")
    assert client.lrange(key, 0, -1) == [new_token]  # exactly one effect

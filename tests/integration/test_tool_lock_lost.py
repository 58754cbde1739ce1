"""A non-cacheable call whose worker lost the call's lock says so (issue 21, item 4).

Real redis-server, real `agentbatch worker` processes (paused with SIGSTOP, killed with
SIGKILL), the simulator over real HTTP.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import redis

from agentbatch import submit_batch
from tests.support.tools import Answer, lookup

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TOOL_TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def _runs(r: redis.Redis) -> int:
    return int(r.get("test:exec:lookup:k0") or 0)


def _submit(redis_url: str, sim_url: str):
    return submit_batch(TOOL_TASK, [{"i": 0}], backend=sim_url, redis_url=redis_url,
                        model="sim-model", output_schema=Answer, tools=[lookup])


def test_a_paused_tool_worker_that_lost_its_lock_reports_the_second_run(
        redis_url, sim_url, start_workers):
    # The paused worker's tool sleeps 8 s, the one that takes the call over 40 s: the paused
    # one, resumed once the other runs the call, returns first and commits its outcome.
    grace = {"AGENTBATCH_QUEUE_GRACE_S": "120"}
    start_workers(1, queues="inference", concurrency=4, env=grace)
    [paused] = start_workers(1, queues="tools", concurrency=4,
                             env={**grace, "TEST_TOOL_SLEEP_S": "8"})
    handle = _submit(redis_url, sim_url)
    r = redis.from_url(redis_url)
    _wait_until(lambda: _runs(r) == 1, 90, "the tool call to start")
    os.kill(paused.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        [other] = start_workers(1, queues="tools", concurrency=4,
                                env={**grace, "TEST_TOOL_SLEEP_S": "40"})
        _wait_until(lambda: _runs(r) == 2, 150, "another worker to run the call")
        taken_over_s = time.monotonic() - stopped
    finally:
        os.kill(paused.proc.pid, signal.SIGCONT)
    results = handle.wait(timeout=120)
    other.kill()
    print(f"\ncall taken over {taken_over_s:.1f}s after SIGSTOP (worker start included)")
    assert results[0].ok, results[0].error
    status = handle.status()
    assert status.get("stat:tool_lock_lost") == 1, status
    assert any("ERROR" in ln and "lock was lost" in ln for ln in paused.log().splitlines()), \
        paused.log()[-3000:]
    assert [c.lock_lost for c in results[0].tool_calls] == [True], results[0].tool_calls


def test_recovery_after_a_tool_worker_is_killed(redis_url, sim_url, start_workers):
    # Reported, not asserted: the seconds from SIGKILL of the worker running the call to
    # another (already running) worker starting it again, and to the result.
    grace = {"AGENTBATCH_QUEUE_GRACE_S": "120"}
    start_workers(1, queues="inference", concurrency=4, env=grace)
    [victim] = start_workers(1, queues="tools", concurrency=4,
                             env={**grace, "TEST_TOOL_SLEEP_S": "60"})
    handle = _submit(redis_url, sim_url)
    r = redis.from_url(redis_url)
    _wait_until(lambda: _runs(r) == 1, 90, "the tool call to start")
    start_workers(1, queues="tools", concurrency=4, env={**grace, "TEST_TOOL_SLEEP_S": "0.1"})
    victim.kill()
    killed = time.monotonic()
    _wait_until(lambda: _runs(r) == 2, 150, "another worker to run the call")
    rerun_s = time.monotonic() - killed
    results = handle.wait(timeout=120)
    done_s = time.monotonic() - killed
    print(f"\nafter SIGKILL: call started again in {rerun_s:.1f}s, result in {done_s:.1f}s")
    assert results[0].ok, results[0].error
    assert [c.lock_lost for c in results[0].tool_calls] == [False]

"""Follow-ups to issue 21's hardening: a plan no worker can read, a damaged state met by a
tool task, and the demo's exit status when some of its agents fail.

Real redis-server, real `agentbatch worker` processes, the simulator over real HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from tests.support.tools import Answer, lookup
from tests.support.workers import REPO

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


def test_a_tool_task_that_meets_a_damaged_state_ends_the_agent_as_internal(
        redis_url, sim_url, start_workers):
    # The agent's first turn asks for a tool; with no tool worker yet, its tool task waits.
    # Its state entry is then damaged (another version's field type), and a tool worker with
    # the sweep switched off starts: the tool task itself must end the agent `internal`, as a
    # claim does, not raise (which left it to the sweep, or, with none, stuck).
    no_sweep = {"AGENTBATCH_SWEEP_INTERVAL_S": "3600"}
    start_workers(1, queues="inference", concurrency=2, env=no_sweep)
    handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}', [{"i": 0}],
                          backend=sim_url, redis_url=redis_url, model="sim-model",
                          output_schema=Answer, tools=[lookup])
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(handle.batch_id)
    _wait_until(lambda: r.hget(k.meta, "n:awaiting_tools") == "1", 90,
                "the agent to wait on its tool")
    version, _, raw = r.hget(k.state, "0").partition(":")
    entry = json.loads(raw)
    assert entry["status"] == "awaiting_tools", entry
    entry["steps"] = "many"  # no longer an int: the entry cannot be read
    r.hset(k.state, "0", f"{version}:{json.dumps(entry)}")
    [tools] = start_workers(1, queues="tools", concurrency=2, env=no_sweep)

    [result] = list(handle.results(timeout=90))
    assert result.error is not None and result.error.kind == "internal", result.error
    assert "stored state cannot be read" in result.error.message, result.error.message
    assert r.hget(k.meta, "finished") == "1"
    assert r.hget(k.meta, "n:awaiting_tools") == "0"  # the placeholder kept its status
    assert "Traceback" not in tools.log(), tools.log()[-3000:]
    assert r.get("test:exec:lookup:k0") is None  # the tool never ran for it


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})  # --help unwrapped


@pytest.mark.parametrize("rates", ["malformed_json=1"])
def test_the_demo_reports_failed_agents_as_data_and_exits_0(rates):
    # Every model reply malformed: each agent ends invalid_output. The batch itself ran, so
    # the demo shows the count and the errors and exits 0 (before: exit 1).
    proc = _cli("demo", "--agents", "3", "--fixed-ms", "5", "--fault-rate", rates)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "0 / 3" in proc.stdout, proc.stdout
    assert "invalid_output" in proc.stdout, proc.stdout


def test_the_demo_states_its_exit_rule_and_refuses_a_bad_fault_rate():
    shown = _cli("demo", "--help")
    assert shown.returncode == 0 and "Exit status: 0 when the batch ran" in shown.stdout, \
        shown.stdout
    bad = _cli("demo", "--agents", "2", "--fault-rate", "bogus=1")
    assert bad.returncode == 2 and "--fault-rate" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    engine = _cli("demo", "--engine", "llamacpp", "--fault-rate", "http_500=0.5")
    assert engine.returncode == 2 and "simulator" in engine.stderr, engine.stderr

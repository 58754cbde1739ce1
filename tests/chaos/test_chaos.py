"""Failover, faults and Redis loss: the distributed engine loses nothing and never hangs."""

from __future__ import annotations

import shutil
import time

import pytest
import redis

from agentbatch import BatchLost, submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.chaos.harness import ChaosConfig, run
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, always_fails, cached_lookup, lookup
from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server binary not installed (.ci/run installs it)"),
]

FAST = {"AGENTBATCH_LEASE_TTL_S": "3", "AGENTBATCH_QUEUE_GRACE_S": "5",
        "AGENTBATCH_SWEEP_INTERVAL_S": "0.5", "TEST_TOOL_SLEEP_S": "0.05"}


def test_scaled_down_chaos_run_keeps_every_invariant():
    report = run(ChaosConfig(agents=200, min_kills=3, compare_without_chaos=False,
                             kill_interval_s=2.0, tool_sleep_s=0.2, timeout_s=600))
    chaos = report["with_chaos"]
    assert report["invariants"] == {k: True for k in report["invariants"]}, chaos
    assert chaos["lost"] == 0 and chaos["duplicated"] == 0
    assert chaos["kills"] >= 3 and chaos["submitter_killed_at_s"] is not None
    # the liveness faults really happened (their invariants are not vacuous)
    assert chaos["pauses"] >= 1 and chaos["poison_messages"] >= 2
    assert chaos["dup_id_agents"] >= 1 and chaos["step_bug_agents"] >= 1
    assert chaos["unloadable_agents"] >= 1


@pytest.fixture
def fleet():
    server = RedisServer().start()
    started: list[WorkerProcess] = []

    def workers(n: int, url: str | None = None, **kw) -> list[WorkerProcess]:
        procs = [WorkerProcess(url or server.url, name=f"f{len(started) + i}",
                               env={**FAST, **kw.pop("env", {})}, **kw).start(wait=False)
                 for i in range(n)]
        for p in procs:
            p.wait_ready()
        started.extend(procs)
        return procs

    yield server, workers
    for p in started:
        p.stop(timeout=15)
    server.cleanup()


TASK = 'Agent {i}.\n@sim tool lookup {{"key": "u{i}"}}\n@sim tool cached_lookup {{"key": "c{c}"}}'


def _inputs(n: int) -> list[dict[str, int]]:
    return [{"i": i, "c": i % 5} for i in range(n)]


def test_backend_faults_end_each_agent_ok_or_with_a_reason(fleet):
    server, workers = fleet
    procs = workers(2, concurrency=16)
    rates = "http_500=0.10,http_429=0.05,malformed_json=0.02,timeout=0.01"
    with SimServer(SimConfig(fixed_ms=5, fault_rates=rates, seed=3, timeout_hold_s=5)) as sim:
        handle = submit_batch(TASK, _inputs(150), tools=[lookup, cached_lookup],
                              output_schema=Answer, model="m",
                              backend="sim://" + sim.url.split("://")[1],
                              redis_url=server.url, timeout_per_turn=1.0, max_retries=3)
        results = handle.wait(timeout=300)
        faults = sim.state.stats.as_dict()["faults"]
    assert len(results) == 150
    assert all(r.ok or (r.error and r.error.kind and r.error.message) for r in results)
    assert sum(r.ok for r in results) >= 140  # retries absorb nearly all injected faults
    assert sum(faults.values()) > 0
    assert all(p.alive for p in procs)


def test_tools_that_always_raise_and_endless_tool_loops_fail_only_those_agents(fleet):
    server, workers = fleet
    workers(1, concurrency=16)
    # an input value is not a template: single braces
    loop_lines = "\n".join(f'@sim tool lookup {{"key": "loop{j}"}}' for j in range(6))
    inputs = [{"i": i, "extra": ""} for i in range(20)]
    inputs[3]["extra"] = loop_lines  # never stops calling tools
    inputs[5]["extra"] = "@sim answer this is never JSON"  # never validates
    with SimServer(SimConfig(fixed_ms=5)) as sim:
        results = submit_batch(
            'Agent {i}.\n@sim tool always_fails {{"key": "{i}"}}\n{extra}', inputs,
            tools=[always_fails, lookup], output_schema=Answer, model="m", max_turns=4,
            backend="sim://" + sim.url.split("://")[1], redis_url=server.url,
        ).wait(timeout=120)
    assert results[3].error.kind == "max_turns"
    assert results[5].error.kind == "invalid_output"
    others = [r for r in results if r.index not in (3, 5)]
    assert all(r.ok and not r.tool_calls[0].ok for r in others)


def test_redis_restart_without_persistence_fails_the_batch_clearly(fleet):
    server, workers = fleet
    procs = workers(1, concurrency=8, env={"TEST_TOOL_SLEEP_S": "1"})
    with SimServer(SimConfig(fixed_ms=5)) as sim:
        backend = "sim://" + sim.url.split("://")[1]
        handle = submit_batch(TASK, _inputs(60), tools=[lookup, cached_lookup],
                              output_schema=Answer, model="m", backend=backend,
                              redis_url=server.url)
        time.sleep(1.5)
        server.kill()
        server.proc = RedisServer(port=server.port, data_dir=server.dir).start().proc
        started = time.monotonic()
        with pytest.raises(BatchLost, match="no longer in Redis"):
            handle.wait(timeout=120)
        assert time.monotonic() - started < 60  # it fails; it does not hang
        # the workers survived and serve the next batch on the restarted server
        nxt = submit_batch("Agent {i}.", [{"i": i} for i in range(5)], model="m",
                           backend=backend, redis_url=server.url).wait(timeout=120)
    assert all(r.ok for r in nxt) and all(p.alive for p in procs)


def test_redis_restart_with_append_only_persistence_loses_nothing(tmp_path):
    server = RedisServer(appendonly=True, data_dir=tmp_path).start()
    redis.from_url(server.url).config_set("appendfsync", "always")
    # Supervised like compose/k8s: after a broker reconnect Celery can stop consuming
    # (celery#8030); the worker's watchdog then exits and the supervisor starts a fresh one.
    env = {**FAST, "TEST_TOOL_SLEEP_S": "0.5", "AGENTBATCH_CONSUMER_STALL_S": "10"}
    procs = [WorkerProcess(server.url, concurrency=8, name=f"aof{i}", env=env, supervise=True)
             for i in range(2)]
    restarted = None
    try:
        for p in procs:
            p.start()
        with SimServer(SimConfig(fixed_ms=5)) as sim:
            handle = submit_batch(TASK, _inputs(60), tools=[lookup, cached_lookup],
                                  output_schema=Answer, model="m",
                                  backend="sim://" + sim.url.split("://")[1],
                                  redis_url=server.url)
            time.sleep(1.5)
            server.kill()
            restarted = RedisServer(port=server.port, data_dir=tmp_path, appendonly=True).start()
            results = handle.wait(timeout=180)
        assert [r.index for r in results] == list(range(60))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        stream = redis.from_url(server.url, decode_responses=True).xrange(
            f"ab:{{{handle.batch_id}}}:results")
        assert len(stream) == 60
        print("worker restarts by the supervisor:", [p.restarts for p in procs])
    except BaseException:
        for p in procs:
            print(f"--- worker {p.name} log tail ---\n{p.log()[-3000:]}")
        raise
    finally:
        for p in procs:
            p.stop(timeout=15)
        (restarted or server).cleanup()


def test_sigterm_hands_back_running_work_and_loses_nothing(fleet):
    server, workers = fleet
    first, _second = workers(2, concurrency=8, env={"TEST_TOOL_SLEEP_S": "0.5"})
    with SimServer(SimConfig(fixed_ms=20)) as sim:
        handle = submit_batch(TASK, _inputs(80), tools=[lookup, cached_lookup],
                              output_schema=Answer, model="m",
                              backend="sim://" + sim.url.split("://")[1], redis_url=server.url)
        time.sleep(1.0)
        first.stop(timeout=60)  # SIGTERM: Celery's warm shutdown
        results = handle.wait(timeout=180)
    assert first.proc.returncode == 0
    assert [r.index for r in results] == list(range(80)) and all(r.ok for r in results)


def test_unreachable_backend_does_not_stop_other_batches(fleet):
    server, workers = fleet
    procs = workers(1, concurrency=8)
    with SimServer(SimConfig(fixed_ms=5)) as sim:
        dead = submit_batch("Agent {i}.", [{"i": i} for i in range(10)], model="m",
                            backend="vllm://127.0.0.1:9", redis_url=server.url,
                            warm_prefix=False, max_retries=1)
        good = submit_batch("Agent {i}.", [{"i": i} for i in range(30)], model="m",
                            backend="sim://" + sim.url.split("://")[1], redis_url=server.url)
        good_results = good.wait(timeout=120)
        dead_results = dead.wait(timeout=120)
    assert all(r.ok for r in good_results)
    assert {r.error.kind for r in dead_results} == {"backend_unavailable"}
    assert all(p.alive for p in procs)

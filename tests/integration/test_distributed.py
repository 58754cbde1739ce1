"""The distributed engine over a real redis-server and real `agentbatch worker` processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import redis
from pydantic import BaseModel

from agentbatch import BatchSpecError, ConfigError, get_batch, submit_batch, tool
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import entry_state
from agentbatch.distributed.workers.app import TOOL_TASK, TURN_TASK, client_app
from tests.support.tools import Answer, always_fails, cached_lookup, lookup
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _submit(redis_url, sim_url, task, inputs, **kw):
    kw.setdefault("model", "sim-model")
    kw.setdefault("output_schema", Answer)
    return submit_batch(task, inputs, backend=sim_url, redis_url=redis_url, **kw)


def _stream_indices(redis_url, batch_id):
    r = redis.from_url(redis_url, decode_responses=True)
    return [int(f["i"]) for _, f in r.xrange(BatchKeys(batch_id).results)]


def test_300_agents_with_tools_each_result_exactly_once(redis_url, sim_url, start_workers):
    start_workers(2, concurrency=16)
    task = ('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}\n'
            '@sim tool cached_lookup {{"key": "c{m}"}}')
    inputs = [{"i": i, "m": i % 7} for i in range(300)]
    handle = _submit(redis_url, sim_url, task, inputs, tools=[lookup, cached_lookup])
    results = handle.wait(timeout=240)
    assert [r.index for r in results] == list(range(300))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert all(isinstance(r.output, Answer) and r.turns == 3 for r in results)
    indices = _stream_indices(redis_url, handle.batch_id)
    assert sorted(indices) == list(range(300))  # one stream entry per agent, no duplicates
    assert handle.status()["finished"] == 1


def test_one_tool_over_six_keys_runs_six_times_across_two_tool_workers(
        redis_url, sim_url, start_workers):
    start_workers(1, queues="inference", concurrency=16)
    start_workers(2, queues="tools", concurrency=8)
    task = 'Agent {i}.\n@sim tool cached_lookup {{"key": "key{k}"}}'
    handle = _submit(redis_url, sim_url, task, [{"i": i, "k": i % 6} for i in range(300)],
                     tools=[cached_lookup])
    results = handle.wait(timeout=240)
    assert all(r.ok for r in results)
    r = redis.from_url(redis_url, decode_responses=True)
    runs = {k: int(r.get(f"test:exec:cached_lookup:key{k}") or 0) for k in range(6)}
    assert runs == dict.fromkeys(range(6), 1)
    shared = sum(c.cached or c.coalesced for res in results for c in res.tool_calls)
    assert shared == 294


def test_duplicated_turn_task_is_dropped(redis_url, sim_url, start_workers):
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool lookup {{"key": "dup"}}',
                     [{"i": 0}], tools=[lookup])
    app = client_app(redis_url)
    app.send_task(TURN_TASK, args=[handle.batch_id, 0, 0, 1], queue="inference")  # a duplicate
    start_workers(1, concurrency=4)
    results = handle.wait(timeout=60)
    assert results[0].ok and results[0].turns == 2
    assert _stream_indices(redis_url, handle.batch_id) == [0]
    status = handle.status()
    # the duplicate was dropped as stale, or found the turn busy and was re-queued to run
    # after the lease (and is then dropped as stale)
    dropped = sum(v for k, v in status.items()
                  if k.startswith("stat:dropped") or k == "stat:requeued_busy")
    assert dropped >= 1, status
    assert int(redis.from_url(redis_url).get("test:exec:lookup:dup")) == 1


def test_a_duplicated_plain_tool_task_waits_for_the_calls_lock_and_the_call_runs_once(
        redis_url, sim_url, start_workers):
    # A plain tool's call takes its lock in the script that starts it; a second delivery of
    # the same call, arriving while the first runs, is re-queued for when that lock would
    # run out, then finds the agent moved on. The call runs once.
    start_workers(1, queues="inference", concurrency=4)
    start_workers(1, queues="tools", concurrency=4, env={"TEST_TOOL_SLEEP_S": "3"})
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool lookup {{"key": "dup2"}}',
                     [{"i": 0}], tools=[lookup])
    r = redis.from_url(redis_url, decode_responses=True)
    deadline = time.monotonic() + 60
    while not r.get("test:exec:lookup:dup2"):  # the call is running
        assert time.monotonic() < deadline, "the tool call never started"
        time.sleep(0.02)
    state = entry_state(r.hget(BatchKeys(handle.batch_id).state, "0"))
    [call] = state.pending_calls
    client_app(redis_url).send_task(
        TOOL_TASK, args=[handle.batch_id, 0, state.version, call.id, call.name, 1],
        queue="tools")
    [result] = handle.wait(timeout=90)
    assert result.ok and result.turns == 2, result.error
    assert int(r.get("test:exec:lookup:dup2")) == 1
    assert handle.status().get("stat:requeued_busy", 0) >= 1  # it met the lock


def test_a_worker_below_debug_writes_no_line_per_task(redis_url, sim_url, start_workers):
    (w,) = start_workers(1, concurrency=4)  # INFO, the default
    results = _submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(4)]).wait(60)
    assert all(r.ok for r in results)
    log = w.log()
    assert "] received" not in log and "] succeeded in" not in log, log[-2000:]
    assert "ready." in log  # the worker does log at INFO


def test_reattach_from_another_process_and_resume_from_a_cursor(
        redis_url, sim_url, start_workers):
    start_workers(1, concurrency=16)
    handle = _submit(redis_url, sim_url, "Agent {i}.", [{"i": i} for i in range(40)])
    first = []
    for result in handle.results(timeout=60):
        first.append(result.index)
        if len(first) == 10:
            break
    cursor = handle.cursor
    rest = [r.index for r in get_batch(handle.batch_id, redis_url=redis_url)
            .results(after=cursor, timeout=60)]
    assert sorted(first + rest) == list(range(40))  # nothing lost, nothing twice
    code = textwrap.dedent(f"""
        import json
        from agentbatch import get_batch
        h = get_batch({handle.batch_id!r}, redis_url={redis_url!r})
        rs = h.wait(timeout=60)
        print(json.dumps([[r.index, r.ok, type(r.output).__name__] for r in rs]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, timeout=120, check=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    assert [row[0] for row in rows] == list(range(40))
    assert all(row[1] and row[2] == "Answer" for row in rows)


def test_cancel_stops_remaining_turns(redis_url, sim_url, start_workers):
    start_workers(1, concurrency=4, env={"TEST_TOOL_SLEEP_S": "2"})
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool lookup {{"key": "c{i}"}}',
                     [{"i": i} for i in range(20)], tools=[lookup])
    handle.cancel()
    results = handle.wait(timeout=90)
    assert len(results) == 20
    kinds = {r.error.kind for r in results if not r.ok}
    assert kinds == {"cancelled"}
    assert sum(not r.ok for r in results) >= 10


def test_a_tool_workers_cannot_import_is_a_structured_error(
        redis_url, sim_url, start_workers, tmp_path, monkeypatch):
    (tmp_path / "private_tools.py").write_text(textwrap.dedent('''
        from agentbatch import tool

        @tool
        def secret(x: str) -> str:
            """Only this process can import me."""
            return x
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    import private_tools

    start_workers(1, concurrency=4)
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool secret {{"x": "1"}}',
                     [{"i": i} for i in range(3)], tools=[private_tools.secret])
    results = handle.wait(timeout=60)
    assert all(r.error.kind == "tool_import" and "secret" in r.error.message for r in results)
    # the worker survived and serves the next batch
    ok = _submit(redis_url, sim_url, "Agent {i}.", [{"i": 0}]).wait(timeout=60)
    assert ok[0].ok


def test_tool_that_always_raises_is_fed_back_not_fatal(redis_url, sim_url, start_workers):
    start_workers(1, concurrency=4)
    handle = _submit(redis_url, sim_url, 'Agent {i}.\n@sim tool always_fails {{"key": "x"}}',
                     [{"i": i} for i in range(3)], tools=[always_fails])
    results = handle.wait(timeout=60)
    assert all(r.ok and not r.tool_calls[0].ok for r in results)


def test_unreachable_redis_is_a_clear_error_before_anything_is_written(sim_url):
    with pytest.raises(ConfigError, match=r"cannot reach Redis at redis://:\*\*\*@127\.0\.0\.1:1"):
        submit_batch("x {i}", [{"i": 1}], model="m", backend=sim_url,
                     redis_url="redis://:hunter2@127.0.0.1:1/0")


def test_unportable_batches_are_refused_at_submit(redis_url, sim_url):
    class LocalSchema(BaseModel):
        a: int

    with pytest.raises(BatchSpecError, match="defined inside a function"):
        submit_batch("x {i}", [{"i": 1}], model="m", backend=sim_url, redis_url=redis_url,
                     output_schema=LocalSchema)

    @tool
    def local_tool(x: str) -> str:
        """Local."""
        return x

    with pytest.raises(BatchSpecError, match="local_tool"):
        submit_batch("x {i}", [{"i": 1}], model="m", backend=sim_url, redis_url=redis_url,
                     tools=[local_tool])
    assert redis.from_url(redis_url).keys("ab:*") == []


def test_unreachable_backend_is_refused_at_warm_up_before_anything_is_written(redis_url):
    from agentbatch.core.errors import BackendUnavailable

    with pytest.raises(BackendUnavailable, match=r"warm-up.*nothing was enqueued"):
        submit_batch("x {i}", [{"i": 1}, {"i": 2}], model="m", backend="vllm://127.0.0.1:9",
                     redis_url=redis_url, timeout_per_turn=2)
    assert redis.from_url(redis_url).keys("ab:*") == []


def test_consumer_watchdog_detects_a_stalled_consumer(redis_url):
    """``stalled()`` reads the real queue lists; the clock is fake (no timing in tests)."""
    from agentbatch.distributed.workers.envelope import queue_key
    from agentbatch.distributed.workers.watchdog import ConsumerWatchdog

    client = redis.from_url(redis_url)
    now = [100.0]
    dog = ConsumerWatchdog(["inference"], stall_s=5, clock=lambda: now[0])
    assert not dog.stalled(client, slots=4)  # nothing waiting
    client.lpush(queue_key("inference", 9), "waiting message")
    assert not dog.stalled(client, slots=4)  # messages just appeared: the clock starts
    now[0] += 10
    assert dog.stalled(client, slots=4)  # idle slots, messages waiting 10 s, nothing received
    dog.received()
    assert not dog.stalled(client, slots=4)  # a receipt restarts the measurement
    client.delete(queue_key("inference", 9))
    now[0] += 10
    assert not dog.stalled(client, slots=4)  # nothing waiting


def test_a_streamed_agents_ttft_reaches_its_result_through_redis(
        redis_url, sim_url, start_workers):
    start_workers(1, concurrency=4)
    task = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'
    inputs = [{"i": i} for i in range(4)]
    streamed = _submit(redis_url, sim_url + "?stream=1", task, inputs, tools=[lookup])
    plain = _submit(redis_url, sim_url, task, inputs, tools=[lookup])
    for r in streamed.wait(timeout=120):
        assert r.ok and r.turns == 2, r.error
        assert r.ttft_s is not None and r.ttft_s > 0
    assert [r.ttft_s for r in plain.wait(timeout=120)] == [None] * 4

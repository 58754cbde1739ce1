"""Retention: what a finished distributed batch leaves in Redis, and for how long.

Real redis-server, real `agentbatch worker` processes, the simulator over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from agentbatch import BatchExpired, ConfigError, get_batch, submit_batch
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, BatchKeys
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import RedisSemaphore
from tests.support.tools import Answer, lookup
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TOOL_TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'
WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support", "TEST_TOOL_SLEEP_S": "0.05"}


def _submit(redis_url: str, sim_url: str, n: int, task: str = TOOL_TASK, **kw: Any):
    return submit_batch(task, [{"i": i} for i in range(n)], backend=sim_url,
                        redis_url=redis_url, model="sim-model", output_schema=Answer,
                        tools=[lookup], **kw)


def _keys(r: redis.Redis, batch_id: str) -> list[str]:
    return sorted(r.scan_iter(match=BatchKeys(batch_id).pattern(), count=1000))


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def test_a_finished_batch_expires_whole_and_a_late_reader_gets_batch_expired(
        redis_url, sim_url, start_workers, monkeypatch):
    monkeypatch.setenv("AGENTBATCH_RETENTION_S", "6")
    start_workers(1, concurrency=8, env=WORKER_ENV)
    handle = _submit(redis_url, sim_url, 20)
    results = handle.wait(timeout=120)
    assert len(results) == 20 and all(r.ok for r in results)
    assert results[0].tool_calls and results[0].turns == 2  # the result keeps the tool log
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(handle.batch_id)
    assert not r.sismember(ACTIVE_BATCHES, handle.batch_id)  # the sweep stops scanning it
    keys = _keys(r, handle.batch_id)
    assert k.plan in keys and k.results in keys and k.gone in keys
    ttls = {key: r.pttl(key) for key in keys}
    # every key of the batch expires (no key without a TTL, -1), the data within retention
    assert all(0 < ms <= 6000 for key, ms in ttls.items() if key != k.gone), ttls
    assert ttls[k.gone] > 6000  # the tombstone outlives the data
    assert not [key for key in keys if ":tr:" in key]  # fan-in hashes went with their round
    # a terminal agent keeps its scalars, not its conversation
    stored = json.loads(r.hget(k.state, "0").partition(":")[2])  # "<version>:<json>"
    assert stored["status"] == "done" and "messages" not in stored
    assert not [key for key in keys if ":msgs:" in key]  # nor its conversation list
    assert not [key for key in keys if ":calls:" in key]  # nor its tool-call log
    assert "tool_log" not in stored and stored["output"] == results[0].output.model_dump()

    _wait_until(lambda: _keys(r, handle.batch_id) == [k.gone], 20, "the batch's keys to expire")
    with pytest.raises(BatchExpired, match="expired after 6s"):
        list(handle.results(timeout=10))
    with pytest.raises(BatchExpired):
        handle.status()
    with pytest.raises(BatchExpired):
        get_batch(handle.batch_id, redis_url=redis_url)


def test_fan_in_hashes_are_deleted_by_the_commit_that_consumes_them(
        redis_url, sim_url, start_workers):
    start_workers(1, concurrency=8, env=WORKER_ENV)
    task = ('Agent {i}.\n@sim tool lookup {{"key": "a{i}"}}\n'
            '@sim tool lookup {{"key": "b{i}"}}')
    handle = _submit(redis_url, sim_url, 10, task=task)  # default retention: 7 days
    results = handle.wait(timeout=120)
    assert all(r.ok and r.turns == 3 for r in results)
    r = redis.from_url(redis_url, decode_responses=True)
    keys = _keys(r, handle.batch_id)
    assert not [key for key in keys if ":tr:" in key], keys
    assert all(0 < r.ttl(key) <= 7 * 24 * 3600 for key in keys if not key.endswith(":gone"))


def test_a_cancelled_batch_expires_like_a_finished_one(redis_url, sim_url, start_workers,
                                                       monkeypatch):
    monkeypatch.setenv("AGENTBATCH_RETENTION_S", "600")
    start_workers(1, concurrency=4, env={**WORKER_ENV, "TEST_TOOL_SLEEP_S": "1"})
    handle = _submit(redis_url, sim_url, 12)
    handle.cancel()
    results = handle.wait(timeout=90)
    assert len(results) == 12 and {r.error.kind for r in results if not r.ok} == {"cancelled"}
    r = redis.from_url(redis_url, decode_responses=True)
    assert not r.sismember(ACTIVE_BATCHES, handle.batch_id)
    ttls = {key: r.ttl(key) for key in _keys(r, handle.batch_id)}
    assert all(0 < s <= 600 for key, s in ttls.items() if not key.endswith(":gone")), ttls


def _cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTBATCH_REDIS_URL": redis_url, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_ls_and_rm_and_delete(redis_url, sim_url, start_workers):
    # no tool worker: the second batch stays running, waiting on its tool calls
    start_workers(1, queues="inference", concurrency=4, env=WORKER_ENV)
    done = _submit(redis_url, sim_url, 3, task="Agent {i}.")
    assert all(r.ok for r in done.wait(timeout=60))
    running = _submit(redis_url, sim_url, 8)
    _wait_until(lambda: running.status().get("awaiting_tools", 0) == 8, 30, "a tool round")

    out = _cli(redis_url, "ls", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["batch_id"]: row for row in map(json.loads, out.stdout.splitlines())}
    assert rows[done.batch_id]["status"] == "finished" and rows[done.batch_id]["ttl_s"] > 0
    assert rows[running.batch_id]["status"] == "running"
    assert rows[running.batch_id]["ttl_s"] is None
    # plan, meta, state and results, plus the tombstone
    assert rows[done.batch_id]["bytes"] > 0 and rows[done.batch_id]["keys"] >= 4
    assert rows[done.batch_id]["age_s"] >= 0
    table = _cli(redis_url, "ls")
    assert table.returncode == 0 and running.batch_id in table.stdout, table.stdout

    refused = _cli(redis_url, "rm", running.batch_id)
    assert refused.returncode == 2 and "--force" in refused.stderr, refused.stderr
    assert running.status()["total"] == 8  # untouched
    forced = _cli(redis_url, "rm", "--force", running.batch_id)
    assert forced.returncode == 0, forced.stderr
    with pytest.raises(BatchExpired, match="deleted"):
        running.status()
    r = redis.from_url(redis_url, decode_responses=True)
    k = BatchKeys(running.batch_id)
    assert not r.sismember(ACTIVE_BATCHES, running.batch_id)
    time.sleep(2)  # the sweep (every 0.5 s) no longer looks at it or writes it back
    assert _keys(r, running.batch_id) == [k.gone]

    assert done.delete() > 0  # finished: no force needed
    with pytest.raises(BatchExpired, match="deleted"):
        list(done.results(timeout=5))
    again = _cli(redis_url, "rm", done.batch_id)
    assert again.returncode == 1 and "deleted" in again.stderr
    missing = _cli(redis_url, "rm", "no-such-batch")
    assert missing.returncode == 1 and "no batch" in missing.stderr


def test_a_forced_delete_mid_tool_call_is_not_written_back(redis_url, sim_url, start_workers):
    start_workers(1, concurrency=8, env={**WORKER_ENV, "TEST_TOOL_SLEEP_S": "3"})
    handle = _submit(redis_url, sim_url, 6)
    r = redis.from_url(redis_url, decode_responses=True)
    _wait_until(lambda: sum(int(v) for v in r.mget(*[f"test:exec:lookup:k{i}"
                                                     for i in range(6)]) if v) >= 3,
                30, "tool calls in flight")
    assert handle.delete(force=True) > 0
    # the tool calls end after the delete: recording their outcomes, counting the dropped
    # work and renewing deadlines must not bring any key of the batch back
    time.sleep(5)
    assert _keys(r, handle.batch_id) == [BatchKeys(handle.batch_id).gone]
    with pytest.raises(BatchExpired, match="deleted"):
        handle.wait(timeout=5)


def test_a_bad_retention_is_refused_at_submit_and_at_worker_start(redis_url, sim_url,
                                                                  monkeypatch):
    for bad in ("-1", "abc", "0", "inf"):
        monkeypatch.setenv("AGENTBATCH_RETENTION_S", bad)
        with pytest.raises(ConfigError, match="AGENTBATCH_RETENTION_S"):
            _submit(redis_url, sim_url, 2)
    assert redis.from_url(redis_url).dbsize() == 0  # nothing written
    env = {**os.environ, "AGENTBATCH_RETENTION_S": "-3",
           "AGENTBATCH_WORKER_IMPORTS": "tests.support"}
    proc = subprocess.run([sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url",
                           redis_url], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "AGENTBATCH_RETENTION_S='-3'" in proc.stderr, proc.stderr


async def test_the_aimd_limit_is_forgotten_once_the_fleet_is_idle(redis_url):
    client = async_client(redis_url)
    try:
        sem = RedisSemaphore(client, Scripts(client), "backend-idle", 8, idle_ms=1500,
                             quiet_ms=0, cooldown_ms=0)
        assert await sem.on_throttle() and await sem.on_throttle()
        assert await sem.effective_limit() == 2
        assert 0 < await client.pttl(sem.aimd_key) <= 1500  # every write refreshes it
        assert await sem.on_success()  # a write: the idle clock starts again
        assert await sem.effective_limit() == 3
        assert 0 < await client.pttl(sem.aimd_key) <= 1500
        deadline = time.monotonic() + 10
        while await client.exists(sem.aimd_key):
            assert time.monotonic() < deadline, "the AIMD hash never expired"
            await asyncio.sleep(0.2)
        assert await sem.effective_limit() == 8  # a new batch starts at the configured limit
        assert await sem.try_acquire("h") and sem.seen_limit is None
    finally:
        await client.aclose()


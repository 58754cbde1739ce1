"""A distributed submit is written in chunks (no Redis command blocks for long), yet a batch
is either whole and live or not there: see ``agentbatch.distributed.submit``.

Real redis-server, no workers (nothing consumes the queue, so what was enqueued is counted).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import redis

from agentbatch import RedisOutOfMemory, submit_batch
from agentbatch.distributed import submit as distributed_submit
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, WATCH, BatchKeys
from agentbatch.distributed.submit import SubmitFailed, chunks
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, PRIORITY_STEPS
from agentbatch.distributed.workers.envelope import queue_key
from tests.support.redis_server import RedisServer
from tests.support.workers import REPO

QUEUES = [queue_key(INFERENCE_QUEUE, p) for p in PRIORITY_STEPS]
NO_BACKEND = "sim://127.0.0.1:9"  # never contacted: warm_prefix=False and no workers


def _submit(url: str, n: int) -> object:
    return submit_batch("Agent {i}.", [{"i": i} for i in range(n)], model="m",
                        backend=NO_BACKEND, redis_url=url, warm_prefix=False)


def _queued_args(r: redis.Redis) -> list[list[object]]:
    out = []
    for key in QUEUES:
        for raw in r.lrange(key, 0, -1):
            body = json.loads(base64.b64decode(json.loads(raw)["body"]))
            out.append(body[0])  # protocol 2 body: (args, kwargs, embed)
    return out


@pytest.fixture
def server():
    s = RedisServer().start()
    yield s
    s.cleanup()


def test_chunks_are_bounded_by_entries_and_bytes():
    sizes = [10] * 25 + [500] + [10] * 3
    got = list(chunks(sizes, lambda n: n, max_entries=10, max_bytes=100))
    assert [len(c) for c in got] == [10, 10, 5, 1, 3]
    assert [n for c in got for n in c] == sizes


def test_a_submit_of_many_chunks_lands_whole(redis_url, monkeypatch):
    monkeypatch.setattr(distributed_submit, "CHUNK_ENTRIES", 50)
    n = 475  # 10 chunks, the last one partial
    r = redis.from_url(redis_url, decode_responses=True)
    r.config_set("slowlog-max-len", 100_000)
    r.config_set("slowlog-log-slower-than", 0)
    r.slowlog_reset()
    try:
        handle = _submit(redis_url, n)
        staged = f"HSET ab:stage:{{{handle.batch_id}}}:".encode()  # then renamed into place
        hsets = [e for e in r.slowlog_get(-1)  # redis-py leaves the command as bytes here
                 if e["command"].startswith(staged) and b":state " in e["command"]]
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
        r.config_set("slowlog-max-len", 128)
    assert len(hsets) == 10, "the states were not written in chunks of CHUNK_ENTRIES"
    k = BatchKeys(handle.batch_id)
    states = r.hgetall(k.state)
    assert sorted(map(int, states)) == list(range(n))
    assert all(json.loads(v.partition(":")[2])["index"] == int(i) for i, v in states.items())
    assert r.hlen(k.state) == n and r.zcard(k.watch) == n
    assert r.exists(k.plan) and r.hget(k.meta, "total") == str(n)
    # committed: the staging expiry is gone from every key (retention comes at the finish)
    assert [r.pttl(key) for key in (k.state, k.watch, k.plan, k.meta)] == [-1] * 4
    assert r.sismember(ACTIVE_BATCHES, handle.batch_id)
    args = _queued_args(r)
    assert len(args) == n
    assert sorted(a[1] for a in args) == list(range(n))
    assert {(a[0], a[2], a[3]) for a in args} == {(handle.batch_id, 0, 1)}
    # the first agent's message is the first a worker takes (kombu BRPOPs the list's tail)
    key = next(q for q in QUEUES if r.llen(q))
    first = json.loads(base64.b64decode(json.loads(r.lindex(key, -1))["body"]))[0]
    assert first[1] == 0


def _assert_no_live_batch(r: redis.Redis) -> None:
    assert r.smembers(ACTIVE_BATCHES) == set()
    assert list(r.scan_iter(match="ab:*:plan")) == []
    assert list(r.scan_iter(match="ab:*:meta")) == []
    assert [r.llen(q) for q in QUEUES] == [0] * len(QUEUES)


def test_a_submit_that_runs_out_of_memory_midway_is_an_error_and_leaves_nothing(
        server, monkeypatch):
    monkeypatch.setattr(distributed_submit, "CHUNK_ENTRIES", 20)
    r = redis.from_url(server.url, decode_responses=True)
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory", used + 300_000)  # room for some chunks of ~1.4 MB of agents
    with pytest.raises(RedisOutOfMemory, match=r"part-way through staging \(2000 agents\)") \
            as failed:
        _submit(server.url, 2000)
    assert "nothing was enqueued" in str(failed.value)
    assert "partial writes were removed" in str(failed.value)
    hset = r.info("commandstats")["cmdstat_hset"]
    assert hset["calls"] >= 4, "it failed on the first chunk: not a mid-way failure"
    assert hset["rejected_calls"] >= 1
    _assert_no_live_batch(r)
    # only the staged deadlines stay, in the fleet's zset, until due: the sweep drops them
    assert r.keys("*") == [WATCH]


def test_redis_killed_midway_is_a_clear_error(server, monkeypatch):
    monkeypatch.setattr(distributed_submit, "CHUNK_ENTRIES", 1)
    watcher = redis.from_url(server.url)

    def kill_after_first_chunk() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not watcher.dbsize():
            time.sleep(0.001)
        server.kill()

    killer = threading.Thread(target=kill_after_first_chunk, daemon=True)
    killer.start()
    with pytest.raises(SubmitFailed, match="part-way through staging") as failed:
        _submit(server.url, 5000)
    killer.join(10)
    msg = str(failed.value)
    assert "nothing was enqueued" in msg and "expire within" in msg


SUBMITTER = """
import sys
from agentbatch import submit_batch
from agentbatch.distributed import submit as distributed_submit
distributed_submit.CHUNK_ENTRIES = 1
submit_batch("Agent {i}.", [{"i": i} for i in range(5000)], model="m",
             backend=%r, redis_url=sys.argv[1], warm_prefix=False)
"""


def test_a_submitter_killed_midway_leaves_only_expiring_keys(server):
    r = redis.from_url(server.url, decode_responses=True)
    proc = subprocess.Popen([sys.executable, "-c", SUBMITTER % NO_BACKEND, server.url],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not r.dbsize():
            assert proc.poll() is None, "the submitter exited before writing anything"
            assert time.monotonic() < deadline, "the submitter wrote nothing in 60 s"
            time.sleep(0.001)
        proc.kill()
    finally:
        proc.kill()
        proc.wait(10)
    keys = [key for key in r.keys("ab:*") if key != WATCH]
    state = next(key for key in keys if key.endswith(":state"))
    assert 0 < r.hlen(state) < 5000, "the submit was not cut short mid-way"
    _assert_no_live_batch(r)
    # The staged deadlines are in the fleet-wide zset, which never expires with a batch: the
    # sweep leaves them while the batch's ``state`` exists and drops them once it is gone.
    assert 0 < r.zcard(WATCH) <= 5000
    ttls = [r.pttl(key) for key in keys]
    assert all(0 < ms <= distributed_submit.STAGING_TTL_MS for ms in ttls), (keys, ttls)

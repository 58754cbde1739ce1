"""Poison queue messages go to the dead-letter list; the worker keeps serving (issue 11 item 3).

Each poison item is LPUSHed raw onto the Redis lists kombu reads, exactly as a buggy or hostile
producer would: an envelope whose protocol-2 body is ``[]`` (Celery stopped with
"Unrecoverable error" and the message went back for the next worker), a non-JSON string (killed
each worker that read it), and an envelope with a gzip compression header whose body inflates
to 1 GiB of zeros (decompressed in full before anything looked at it).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import zlib
from functools import cache
from pathlib import Path

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import DEAD_LETTERS
from agentbatch.distributed.workers.app import TURN_TASK, client_app
from agentbatch.distributed.workers.envelope import envelope
from tests.support.tools import Answer, lookup
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

# tools these tests' workers may import (the worker import allow-list)
WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
BOMB_INFLATED = 1 << 30  # 1 GiB of zeros once inflated
RSS_BOUND_KB = 600 * 1024  # a worker that inflated the bomb would peak above 1 GiB


@cache
def _gzip_bomb() -> bytes:
    """zlib of 1 GiB of zeros (about 1 MB), built 1 MiB at a time so the test stays small."""
    comp = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    parts = [comp.compress(chunk) for _ in range(BOMB_INFLATED >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)


def _poison_items(redis_url: str, queue: str) -> dict[str, str]:
    app = client_app(redis_url)
    _, good = envelope(app, TURN_TASK, ["no-such-batch", 0, 0], queue, 9)
    empty_body = json.loads(good)
    empty_body["body"] = base64.b64encode(b"[]").decode()
    bomb = json.loads(good)
    bomb["body"] = base64.b64encode(_gzip_bomb()).decode()
    bomb["headers"]["compression"] = "application/x-gzip"
    return {"empty_body": json.dumps(empty_body), "not_json": f"garbage on {queue} {{",
            "gzip_bomb": json.dumps(bomb)}


def _peak_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc status")


def _wait_done_or_dead(handle, worker: WorkerProcess, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.status().get("finished") == 1:
            return
        if not worker.alive:
            raise AssertionError(f"worker died: {worker.log()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"batch not finished in {timeout}s: {handle.status()}; "
                         f"log: {worker.log()[-3000:]}")


def _cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", "dead-letters", *args,
                           "--redis-url", redis_url], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_poison_messages_are_dead_lettered_and_the_worker_keeps_serving(
        redis_url, sim_url, start_workers):
    r = redis.from_url(redis_url, decode_responses=True)
    pushed: dict[str, str] = {}
    for queue in ("inference", "tools"):
        for kind, raw in _poison_items(redis_url, queue).items():
            r.lpush(queue, raw)
            pushed[f"{queue}/{kind}"] = raw
    handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "p{i}"}}',
                          [{"i": i} for i in range(6)], model="sim-model", backend=sim_url,
                          redis_url=redis_url, output_schema=Answer, tools=[lookup])
    (worker,) = start_workers(1, concurrency=4, env=WORKER_ENV)
    pid = worker.proc.pid
    _wait_done_or_dead(handle, worker)
    results = handle.wait(timeout=60)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert worker.alive and worker.proc.pid == pid

    deadline = time.monotonic() + 60
    while r.llen(DEAD_LETTERS) < len(pushed) and time.monotonic() < deadline:
        time.sleep(0.2)
    letters = [json.loads(x) for x in r.lrange(DEAD_LETTERS, 0, -1)]
    assert len(letters) == len(pushed), letters
    for key, raw in pushed.items():
        queue, kind = key.split("/")
        match = [x for x in letters if x["queue"] == queue and raw.startswith(x["raw"])]
        assert len(match) == 1, (key, [(x["queue"], x["reason"]) for x in letters])
        if kind == "gzip_bomb":
            assert "compress" in match[0]["reason"]
    assert all(r.llen(q) == 0 for q in ("inference", "tools"))
    assert r.hlen("unacked") == 0  # nothing left for kombu to restore onto the next worker
    assert _peak_rss_kb(pid) < RSS_BOUND_KB, "the worker inflated the gzip bomb"
    log = worker.log()
    assert all(log.count(x["id"]) == 1 for x in letters), log[-3000:]  # logged once each
    assert log.count("was refused") == len(pushed), log[-3000:]
    assert "Unrecoverable error" not in log

    listed = _cli(redis_url, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
    assert sorted(x["id"] for x in rows) == sorted(x["id"] for x in letters)
    table = _cli(redis_url, "ls")
    assert table.returncode == 0 and f"{len(pushed)} dead letter" in table.stdout, table.stdout

    first = letters[0]["id"]
    assert _cli(redis_url, "drop", first).returncode == 0
    assert first not in [json.loads(x)["id"] for x in r.lrange(DEAD_LETTERS, 0, -1)]
    assert r.llen(DEAD_LETTERS) == len(pushed) - 1
    missing = _cli(redis_url, "drop", "no-such-id")
    assert missing.returncode != 0 and "no-such-id" in missing.stderr + missing.stdout
    assert _cli(redis_url, "drop", "--all").returncode == 0
    assert r.llen(DEAD_LETTERS) == 0


def test_a_poison_message_does_not_stop_the_next_worker(redis_url, sim_url, start_workers):
    """The ``[]`` body used to go back on the queue (unacked) and kill every later worker."""
    r = redis.from_url(redis_url, decode_responses=True)
    r.lpush("inference", _poison_items(redis_url, "inference")["empty_body"])
    (first,) = start_workers(1, concurrency=2, env=WORKER_ENV)
    deadline = time.monotonic() + 60
    while r.llen(DEAD_LETTERS) < 1 and first.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    first.stop()
    (second,) = start_workers(1, concurrency=2, env=WORKER_ENV)
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(3)], model="sim-model",
                          backend=sim_url, redis_url=redis_url, output_schema=Answer)
    _wait_done_or_dead(handle, second)
    assert r.llen(DEAD_LETTERS) == 1
    assert "Unrecoverable error" not in first.log() + second.log()

"""Redis out of memory (``maxmemory`` + ``noeviction``, as compose and k8s ship it): a clear
error in ``status``, once in the worker log, and to a waiting reader; never a silent stall.

Its own redis-server (the session's is shared), a real worker, the simulator over HTTP.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from agentbatch import RedisOutOfMemory, submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, lookup
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    srv = RedisServer().start()  # --maxmemory-policy noeviction
    yield srv
    srv.cleanup()


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def test_out_of_memory_is_an_error_in_status_the_log_and_the_reader(server, sim_url):
    worker = WorkerProcess(server.url, concurrency=4, name="oom",
                           env={"TEST_TOOL_SLEEP_S": "0.5"})
    worker.start()
    try:
        r = redis.from_url(server.url, decode_responses=True)
        handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                              [{"i": i} for i in range(30)], backend=sim_url,
                              redis_url=server.url, model="sim-model", output_schema=Answer,
                              tools=[lookup])
        _wait_until(lambda: handle.status()["delivered"] >= 3, 60, "the first results")
        r.config_set("maxmemory", "1mb")  # below what is in use: every write is refused
        log_start = len(worker.log())

        with pytest.raises(RedisOutOfMemory, match="out of memory") as status_error:
            handle.status()
        assert status_error.value.status["total"] == 30
        cli = subprocess.run([sys.executable, "-m", "agentbatch.cli", "status",
                              handle.batch_id, "--redis-url", server.url],
                             capture_output=True, text=True, cwd=REPO, timeout=60,
                             env={**os.environ, "COLUMNS": "300"})
        assert cli.returncode == 2 and "out of memory" in cli.stderr, cli.stderr

        seen: list[int] = []
        with pytest.raises(RedisOutOfMemory, match="maxmemory"):
            for result in handle.results(timeout=60):  # raises long before this timeout
                seen.append(result.index)
        cursor = handle.cursor

        time.sleep(3)  # the consumer's reconnect loop and the sweep keep failing meanwhile
        during = worker.log()[log_start:]
        assert during.count("Redis is out of memory") == 1, during[-3000:]
        assert "OutOfMemoryError" not in during and "Cannot connect" not in during, \
            during[-3000:]

        r.config_set("maxmemory", "0")  # memory freed: the batch resumes by itself
        seen += [res.index for res in handle.results(after=cursor, timeout=120)]
        assert sorted(seen) == list(range(30))
        _wait_until(lambda: "accepts writes again" in worker.log(), 30, "the recovery line")
        entries = r.xrange(BatchKeys(handle.batch_id).results)
        assert Counter(int(f["i"]) for _, f in entries) == Counter(range(30))  # each once
    finally:
        worker.stop()

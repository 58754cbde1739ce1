"""A results reader rides out a short Redis outage the same way whether it reads with
``results()`` or ``aresults()``: the outage is retried for up to the reconnect window, and the
batch's results all arrive once Redis is back (append-only persistence keeps them)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
from pathlib import Path

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.core.results import AgentResult
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, lookup
from tests.support.workers import WorkerProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None,
                       reason="redis-server binary not installed (.ci/run installs it)"),
]

ENV = {"AGENTBATCH_LEASE_TTL_S": "3", "AGENTBATCH_QUEUE_GRACE_S": "5",
       "AGENTBATCH_SWEEP_INTERVAL_S": "0.5", "TEST_TOOL_SLEEP_S": "0.3",
       "AGENTBATCH_CONSUMER_STALL_S": "10"}
TASK = 'Agent {i}.\n@sim tool lookup {{"key": "{i}"}}'
AGENTS = 20


@pytest.mark.parametrize("reader", ["results", "aresults"])
def test_a_reader_survives_a_redis_restart(tmp_path: Path, reader: str) -> None:
    server = RedisServer(appendonly=True, data_dir=tmp_path).start()
    redis.from_url(server.url).config_set("appendfsync", "always")
    worker = WorkerProcess(server.url, concurrency=4, name=f"outage-{reader}", env=ENV,
                           supervise=True)
    restarted: RedisServer | None = None
    try:
        worker.start()
        with SimServer(SimConfig(fixed_ms=5)) as sim:
            handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], tools=[lookup],
                                  output_schema=Answer, model="m",
                                  backend="sim://" + sim.url.split("://")[1],
                                  redis_url=server.url)
            got: list[AgentResult] = []
            failure: list[BaseException] = []
            first = threading.Event()

            def read() -> None:
                try:
                    if reader == "results":
                        for result in handle.results(timeout=180):
                            got.append(result)
                            first.set()
                        return

                    async def drain() -> None:
                        async for result in handle.aresults():
                            got.append(result)
                            first.set()

                    asyncio.run(asyncio.wait_for(drain(), timeout=180))
                except BaseException as exc:  # reported to the test thread
                    failure.append(exc)
                finally:
                    first.set()

            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            assert first.wait(120), "no result arrived before the outage"
            server.kill()
            time.sleep(2.0)  # the reader's blocking read fails and it must retry
            restarted = RedisServer(port=server.port, data_dir=tmp_path,
                                    appendonly=True).start()
            thread.join(200)
        assert not thread.is_alive(), "the reader hung"
        assert not failure, f"{reader}() raised through a 2 s outage: {failure[0]!r}"
        assert sorted(r.index for r in got) == list(range(AGENTS))
    except BaseException:
        print(f"--- worker log tail ---\n{worker.log()[-3000:]}")
        raise
    finally:
        worker.stop(timeout=15)
        (restarted or server).cleanup()

"""Fixtures that start the real thing: redis-server, the simulator, worker processes."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.redis_server import RedisServer
from tests.support.workers import WorkerProcess

# boto3's credential chain would otherwise probe the EC2 metadata address (169.254.169.254);
# tests send traffic to loopback only.
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
# Fake AWS credentials so Bedrock backends can be built offline (Stubber tests); a test of
# the missing-credentials error removes them itself.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server binary not installed (apt-get install redis-server); "
           ".ci/run installs it",
)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on the session's throwaway server."""
    import redis

    client = redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.close()


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Any]:
    """agentbatch's asyncio client (``async_client``, what workers use) on ``redis_url``'s
    clean database; closed after the test."""
    from agentbatch.distributed.state.connection import async_client

    client = async_client(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5)) as server:
        yield server


@pytest.fixture
def sim_url(sim: SimServer) -> str:
    return "sim://" + sim.url.split("://", 1)[1]


@pytest.fixture
def start_workers(redis_url: str):
    started: list[WorkerProcess] = []

    def start(n: int = 1, **kwargs) -> list[WorkerProcess]:
        procs = [WorkerProcess(redis_url, name=f"w{len(started) + i}", **kwargs)
                 for i in range(n)]
        for p in procs:
            p.start(wait=False)
        for p in procs:
            p.wait_ready()
        started.extend(procs)
        return procs

    yield start
    for p in started:
        p.stop(timeout=15)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Worker and redis logs, data dirs and rendered ACL files (passwords) live in one scratch
    dir, removed at exit; a failed session keeps it and says where, for the logs."""
    from tests.support import scratch

    if exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        kept = scratch.keep()
        if kept is not None:
            print(f"\nagentbatch test logs kept in {kept}")

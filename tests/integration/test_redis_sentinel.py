"""High availability: a batch rides through the loss of its Redis primary under Sentinel;
Redis Cluster is refused with one clear message.

Real parts only: redis-server (primary + replica, AOF), three redis-sentinel processes, real
`agentbatch worker` processes and the simulator; the primary is SIGKILLed mid-batch.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator

import pytest
import redis

from agentbatch import ConfigError, submit_batch
from agentbatch.distributed.state.connection import (
    CLUSTER_UNSUPPORTED,
    async_client,
    check_url,
    mask_url,
    sync_client,
)
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.pure_tools import stamp
from tests.support.redis_server import free_port
from tests.support.sentinel import SentinelGroup, wait_for
from tests.support.workers import REPO, WorkerProcess

pytestmark = [
    pytest.mark.redis, pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-sentinel") is None or shutil.which("redis-server")
                       is None, reason="needs redis-server and redis-sentinel (Debian "
                                       "packages); .ci/run installs them"),
]

AGENTS = 300
TASK = 'Agent {i}.\n@sim tool stamp {{"key": "k{i}"}}'  # two model turns and one tool call


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    g = SentinelGroup(down_after_ms=1000).start()
    yield g
    g.cleanup()


@pytest.fixture
def slow_sim_url() -> Iterator[str]:
    """Turns of 150 ms, so 300 agents take long enough to lose the primary mid-batch."""
    with SimServer(SimConfig(fixed_ms=150)) as server:
        yield "sim://" + server.url.split("://", 1)[1]


def test_batch_survives_sigkill_of_the_primary(group: SentinelGroup, slow_sim_url: str) -> None:
    workers = [WorkerProcess(group.url, name=f"ha{i}", concurrency=16,
                             env={"AGENTBATCH_WORKER_IMPORTS": "tests.support.pure_tools"})
               for i in range(2)]
    try:
        for w in workers:
            w.start(wait=False)
        for w in workers:
            w.wait_ready()
        handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], backend=slow_sim_url,
                              model="sim-model", tools=[stamp], redis_url=group.url)
        seen: Counter[int] = Counter()
        killed = threading.Event()
        for result in handle.results(timeout=300):
            seen[result.index] += 1
            assert result.ok, result.error
            if not killed.is_set() and sum(seen.values()) >= AGENTS // 4:
                group.kill_primary()  # a quarter delivered: three quarters still in flight
                killed.set()
        assert killed.is_set()
        assert group.primary_port_now() == group.replica_port  # a failover really happened
        missing = sorted(set(range(AGENTS)) - set(seen))
        twice = sorted(i for i, n in seen.items() if n > 1)
        assert (missing, twice) == ([], []), "every agent's result exactly once"
        # the stream on the new primary holds each agent once, too
        client = sync_client(group.url)
        indices = Counter(int(f["i"]) for _, f in client.xrange(BatchKeys(handle.batch_id)
                                                                 .results))
        assert sorted(indices) == list(range(AGENTS)) and max(indices.values()) == 1
        assert handle.status()["finished"] == 1
        assert all(w.alive for w in workers), "workers ride through; none died"
    finally:
        for w in workers:
            w.stop(timeout=15)


def test_commands_during_the_failover_reach_the_new_primary(group: SentinelGroup) -> None:
    """A command issued while there is no primary is retried, re-asking the sentinels, and
    lands on the promoted replica (redis-py alone would retry the dead address only)."""
    sync = sync_client(group.url)
    aio = async_client(group.url)
    loop = asyncio.new_event_loop()
    try:
        sync.set("before", "1")
        loop.run_until_complete(aio.set("before-async", "1"))  # both hold a connection now
        group.kill_primary()
        assert sync.incr("during") == 1
        assert loop.run_until_complete(aio.incr("during-async")) == 1
        assert group.primary_port_now() == group.replica_port
        promoted = redis.Redis(port=group.replica_port, decode_responses=True)
        assert promoted.get("during") == "1" and promoted.get("during-async") == "1"
    finally:
        loop.run_until_complete(aio.aclose())
        loop.close()
        sync.close()


def test_sentinel_url_reaches_the_primary_and_masks_its_password(group: SentinelGroup) -> None:
    client = sync_client(group.url)
    assert client.set("probe", "1") and client.get("probe") == "1"
    direct = redis.Redis(port=group.primary_port, decode_responses=True)
    assert direct.get("probe") == "1"  # the write went to the primary sentinel named
    url = "sentinel://:s3cret@h1:26379,h2:26380/agentbatch?db=2"
    check_url(url)
    assert "s3cret" not in mask_url(url) and "h1:26379,h2:26380/agentbatch" in mask_url(url)


@pytest.mark.parametrize("url", ["redis+cluster://127.0.0.1:7000/0",
                                 "rediss+cluster://h:7000", "cluster://h:7000"])
def test_a_cluster_url_is_refused_and_points_to_sentinel(url: str) -> None:
    with pytest.raises(ConfigError, match="Redis Cluster is not supported") as info:
        check_url(url)
    assert "sentinel://" in str(info.value) and "ab:batches" in str(info.value)


@pytest.mark.parametrize("url", ["sentinel://h1,h2", "sentinel://h1:x/m",
                                 "sentinel://h1/m?ssl_ca_certs=/ca.pem", "sentinels://h1/m"])
def test_a_bad_sentinel_url_is_a_clear_error(url: str) -> None:
    with pytest.raises(ConfigError):
        check_url(url)


@pytest.fixture
def cluster_node(tmp_path) -> Iterator[str]:
    """A redis-server started in cluster mode (one node, no slots assigned)."""
    port = free_port()
    while port > 55000:  # the cluster bus listens on port + 10000
        port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port",
                             str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
                             "--save", "", "--cluster-enabled", "yes",
                             "--cluster-config-file", str(tmp_path / "nodes.conf"),
                             "--logfile", str(tmp_path / "redis.log")])
    try:
        probe = redis.Redis(port=port, socket_timeout=1)
        wait_for("the cluster-mode redis-server", probe.ping, 10,
                 lambda: (tmp_path / "redis.log").read_text(errors="replace")[-1500:]
                 if (tmp_path / "redis.log").exists() else "")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_redis_url_to_a_cluster_node_is_refused_at_submit(cluster_node: str,
                                                            sim_url: str) -> None:
    with pytest.raises(ConfigError) as info:
        submit_batch("Agent {i}.", [{"i": 0}], backend=sim_url, model="sim-model",
                     redis_url=cluster_node)
    assert CLUSTER_UNSUPPORTED in str(info.value)


def test_a_worker_pointed_at_a_cluster_node_refuses_to_start(cluster_node: str) -> None:
    env = WorkerProcess(cluster_node).env
    proc = subprocess.run([sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url",
                           cluster_node], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Redis Cluster is not supported" in proc.stderr

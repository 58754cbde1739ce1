"""Flower, for real: a real worker, a real Flower process, and a small distributed batch.

What a person running a batch should be able to do in Flower: find each agent's turns by
task name (``agentbatch.turn``) and read the batch id, agent index, version and turn from
the args, and see the workers that ran them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbatch import submit_batch
from agentbatch.distributed.workers.app import TURN_TASK
from agentbatch.sim.server import SimServer
from tests.support.redis_server import RedisServer, free_port
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

AGENTS = 5


class FlowerProcess:
    """``python -m celery -A agentbatch.distributed.workers --broker=URL flower`` on a free
    local port."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="agentbatch-flower-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FlowerProcess:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "AGENTBATCH_REDIS_URL": self.redis_url,
            "FLOWER_UNAUTHENTICATED_API": "true",
            # as compose/ and k8s/ deploy it: the task list shows args (batch, agent, ...)
            "FLOWER_TASKS_COLUMNS": "name,args,state,received,runtime,worker",
        }
        cmd = [sys.executable, "-m", "celery", "-A", "agentbatch.distributed.workers",
               f"--broker={self.redis_url}", "flower", f"--port={self.port}",
               "--address=127.0.0.1"]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self._wait_healthy()
        return self

    def _wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"flower exited: {self.log()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthcheck", timeout=1).text == "OK":
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"flower not healthy: {self.log()[-3000:]}")

    def get(self, path: str, **params: Any) -> Any:
        reply = httpx.get(self.url + path, params=params, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        self.log_path.unlink(missing_ok=True)


def _shown_args(task: dict[str, Any]) -> tuple[str, int, int, int]:
    """(batch, agent, version, turn) from the args Flower shows: ``batch=<id> agent=3
    turn=1 version=2`` (the named ``argsrepr`` of agentbatch/distributed/workers/envelope.py)."""
    named = dict(pair.split("=", 1) for pair in task["args"].split())
    return (named["batch"], int(named["agent"]), int(named["version"]),
            int(named.get("turn", 0)))


def _poll(what: str, check: Callable[[], Any], timeout: float = 60,
          on_timeout: Callable[[], str] = lambda: "") -> Any:
    """Call ``check`` until it returns something truthy; its last error or value on timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, AssertionError, KeyError, ValueError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last: {last!r}\n{on_timeout()}")


@pytest.fixture
def stack() -> Iterator[tuple[RedisServer, WorkerProcess, SimServer, FlowerProcess]]:
    """redis-server, one worker, an in-process simulator and Flower; all torn down after."""
    redis_server = worker = sim = flower = None
    try:
        redis_server = RedisServer().start()
        worker = WorkerProcess(redis_server.url, concurrency=4, name="flowerw").start()
        sim = SimServer(fixed_ms=5).__enter__()
        flower = FlowerProcess(redis_server.url).start()
        yield redis_server, worker, sim, flower
    finally:
        if flower is not None:
            flower.stop()
        if sim is not None:
            sim.__exit__(None, None, None)
        if worker is not None:
            worker.stop(timeout=15)
            worker.log_path.unlink(missing_ok=True)
        if redis_server is not None:
            redis_server.cleanup()


def test_flower_lists_each_agents_turns_with_readable_args_and_the_worker(stack):
    redis_server, worker, sim, flower = stack
    worker_name = f"flowerw-{os.getpid()}@"

    def diagnostics() -> str:
        return (f"--- flower log ---\n{flower.log()[-2000:]}\n"
                f"--- worker log ---\n{worker.log()[-2000:]}")

    # Task events travel over Redis pub/sub: Flower sees only what is sent after it has
    # subscribed. A worker heartbeat reaching Flower proves it is listening.
    def worker_alive_in_flower() -> bool:
        status = flower.get("/api/workers", status="1")
        return any(name.startswith(worker_name) and alive for name, alive in status.items())

    _poll("the worker's heartbeat to reach Flower", worker_alive_in_flower,
          on_timeout=diagnostics)

    backend = "sim://" + sim.url.split("://", 1)[1]
    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(AGENTS)], model="m",
                          backend=backend, redis_url=redis_server.url)
    results = handle.wait(timeout=60)
    assert [r.index for r in results] == list(range(AGENTS))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]

    def turns_listed() -> dict[int, dict[str, Any]]:
        tasks = flower.get("/api/tasks", taskname=TURN_TASK)
        by_agent: dict[int, dict[str, Any]] = {}
        for task in tasks.values():
            args = _shown_args(task)
            if args[0] == handle.batch_id and task["state"] == "SUCCESS":
                by_agent[args[1]] = task
        return by_agent if set(by_agent) == set(range(AGENTS)) else {}

    by_agent = _poll("Flower to list a finished agentbatch.turn per agent", turns_listed,
                     on_timeout=diagnostics)
    for index, task in by_agent.items():
        assert task["name"] == TURN_TASK
        batch_id, agent, version, turn = _shown_args(task)
        assert (batch_id, agent) == (handle.batch_id, index)
        assert isinstance(version, int) and isinstance(turn, int)
        assert task["worker"].startswith(worker_name)
        # the args a person reads in the UI name the batch and the agent in plain text
        assert handle.batch_id in task["args"]

    # a person finds one batch's tasks, or one agent's, with Flower's search syntax
    found = flower.get("/api/tasks", search=f"name:{TURN_TASK} args:{handle.batch_id}")
    assert {_shown_args(t)[1] for t in found.values()} == set(range(AGENTS))
    shown = by_agent[3]["args"]  # as the UI shows it: batch=<id> agent=3 turn=1 version=2
    prefix = f"batch={handle.batch_id} agent=3 "
    assert shown.startswith(prefix), shown
    one = flower.get("/api/tasks", search=f'args:"{prefix}"')
    assert {_shown_args(t)[1] for t in one.values()} == {3}, (prefix, one)
    # and the task list page has the args column
    page = httpx.get(flower.url + "/tasks", timeout=30).text
    assert 'data-column="args"' in page

    # the task type is registered, and the worker answers Flower's inspect call
    assert TURN_TASK in flower.get("/api/task/types")["task-types"]
    workers = _poll("Flower's inspect of the workers",
                    lambda: flower.get("/api/workers", refresh="1"), on_timeout=diagnostics)
    names = [n for n in workers if n.startswith(worker_name)]
    assert names, workers
    stats = workers[names[0]].get("stats", {})
    assert stats.get("pool", {}).get("max-concurrency") == 4, stats.get("pool")
    queues = {q["name"] for q in workers[names[0]].get("active_queues", [])}
    assert queues == {"inference", "tools"}

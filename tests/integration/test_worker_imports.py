"""Plans cannot make workers import arbitrary modules or run Celery's built-in tasks.

Real `agentbatch worker` processes, a real redis-server and the simulator. A worker imports
tools and schemas only under ``AGENTBATCH_WORKER_IMPORTS``; ``tests.support.import_marker``
records every process that imports it, so the tests prove it was never imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, SWEEP_TASK, client_app
from agentbatch.distributed.workers.envelope import envelope, queue_key
from tests.support.import_marker import MarkedAnswer, marked
from tests.support.tools import lookup
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]

NARROW = "tests.support.tools,agentbatch.toolpool.builtins"  # import_marker is outside it
MARKER_KEY = "test:imported:import_marker"
EXAMPLE = "AGENTBATCH_WORKER_IMPORTS=mypkg.tools,agentbatch.toolpool.builtins"


def _worker_cli(redis_url: str, imports: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AGENTBATCH_WORKER_IMPORTS"}
    env["PYTHONPATH"] = str(REPO)
    if imports is not None:
        env["AGENTBATCH_WORKER_IMPORTS"] = imports
    cmd = [sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url", redis_url,
           "--concurrency", "1"]
    try:
        return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired as exc:  # it started and kept running
        pytest.fail(f"the worker started with AGENTBATCH_WORKER_IMPORTS={imports!r}: "
                    f"{(exc.stdout or b'')[-2000:]!r}")


def test_worker_command_refuses_to_start_without_the_import_allowlist(redis_url: str) -> None:
    proc = _worker_cli(redis_url, None)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and EXAMPLE in out, out[-3000:]
    bad = _worker_cli(redis_url, "mypkg.tools,../evil")
    out = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "'../evil' is not a dotted module name" in out, out[-3000:]


def _wait_failed(handle, n: int) -> list:
    results = handle.wait(timeout=120)
    assert len(results) == n
    assert all(not r.ok for r in results), [r.error for r in results]
    return results


def test_tool_outside_the_allowlist_ends_the_agent_and_is_never_imported(
        redis_url: str, sim_url: str, start_workers) -> None:
    (w,) = start_workers(1, concurrency=4, env={"AGENTBATCH_WORKER_IMPORTS": NARROW,
                                                "TEST_IMPORT_MARKER_KEY": MARKER_KEY})
    handle = submit_batch('Agent {i}.\n@sim tool marked {{"key": "k{i}"}}',
                          [{"i": 0}, {"i": 1}], tools=[marked], model="sim-model",
                          backend=sim_url, redis_url=redis_url)
    for r in _wait_failed(handle, 2):
        assert r.error.kind == "tool_import", r.error
        assert "AGENTBATCH_WORKER_IMPORTS" in r.error.message
        assert "tests.support.import_marker" in r.error.message
    schema = submit_batch("Agent {i}.", [{"i": 0}], output_schema=MarkedAnswer,
                          model="sim-model", backend=sim_url, redis_url=redis_url)
    (r,) = _wait_failed(schema, 1)
    assert r.error.kind == "schema_import" and "AGENTBATCH_WORKER_IMPORTS" in r.error.message
    assert w.alive
    assert redis.from_url(redis_url).lrange(MARKER_KEY, 0, -1) == []  # never imported


def test_plan_rewritten_in_redis_cannot_name_os_system(
        redis_url: str, sim_url: str, start_workers) -> None:
    handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}', [{"i": 0}],
                          tools=[lookup], model="sim-model", backend=sim_url,
                          redis_url=redis_url)
    client = redis.from_url(redis_url)
    key = BatchKeys(handle.batch_id).plan
    plan = client.get(key).decode()
    assert plan.count("tests.support.tools:lookup") == 1
    client.set(key, plan.replace("tests.support.tools:lookup", "os:system"))
    start_workers(1, concurrency=4, env={"AGENTBATCH_WORKER_IMPORTS": NARROW})
    (r,) = _wait_failed(handle, 1)
    assert r.error.kind == "tool_import", r.error
    assert "'os:system'" in r.error.message and "AGENTBATCH_WORKER_IMPORTS" in r.error.message


def test_celery_builtin_tasks_are_not_run_and_the_worker_still_serves(
        redis_url: str, sim_url: str, start_workers) -> None:
    # DEBUG: the per-task "received"/"succeeded" lines are logged, so their absence for the
    # built-in tasks below means something (the batch's own tasks do log them)
    (w,) = start_workers(1, concurrency=4, loglevel="DEBUG")
    app = client_app(redis_url)
    client = redis.from_url(redis_url)
    sweep = {"task": SWEEP_TASK, "args": [], "kwargs": {}, "options": {},
             "subtask_type": None, "immutable": False}
    messages = {
        "celery.accumulate": [1, 2],
        "celery.map": [sweep, [[]]],
        "celery.chord_unlock": ["some-group-id", sweep],
        "celery.backend_cleanup": [],
    }
    ids = {}
    for name, args in messages.items():
        list_key, payload = envelope(app, name, args, INFERENCE_QUEUE, 9)
        ids[name] = json.loads(payload)["headers"]["id"]
        client.lpush(list_key, payload)
    handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                          [{"i": i} for i in range(4)], tools=[lookup], model="sim-model",
                          backend=sim_url, redis_url=redis_url)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results]
    deadline = time.monotonic() + 60
    wanted = [f"Received unregistered task of type '{name}'" for name in messages]
    while not all(line in w.log() for line in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    log = w.log()
    for name, task_id in ids.items():
        assert f"Received unregistered task of type '{name}'" in log, log[-3000:]
        assert f"[{task_id}] received" not in log and f"[{task_id}] succeeded" not in log
    assert "] received" in log and "] succeeded in" in log  # the batch's own tasks
    assert client.llen(queue_key(INFERENCE_QUEUE, 9)) == 0  # discarded, not left to loop
    assert w.alive

"""Chained pipelines: the workers submit each stage after the one before, so the submitter may die.

A subprocess starts a distributed ``run_with_reduce`` (or ``run_with_map_reduce``) and is
SIGKILLed once its first stage is in Redis; this process re-attaches with ``get_pipeline``
and gets every map result and the final ``reduced``. The simulator (in this process, over
real HTTP) records every request, so the reduce agents are counted where they ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from pydantic import BaseModel

from agentbatch import PipelineError, get_pipeline
from agentbatch.distributed.state.keys import BatchKeys, PipelineKeys
from agentbatch.patterns.pipeline_chain import stage_finished
from agentbatch.patterns.pipeline_spec import PipelineSpec, StageSpec
from agentbatch.sim import handlers
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.redis_server import RedisServer
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis]

CHAIN_DB = 10  # this module's worker has its own database
ALLOWED = ("tests.support", "tests.integration.test_pipeline_chain")
REDUCE = ('REDUCE level={level} n={n} ok={ok}\n'
          '@sim answer {{"summary": "s", "count": {ok}}}')
DEADLINE_S = 120.0


class Claim(BaseModel):
    claim: str


class Summary(BaseModel):
    summary: str
    count: int


class Plan(BaseModel):
    items: list[str]


@dataclass
class Seen:
    texts: list[str] = field(default_factory=list)

    def reduces(self) -> int:
        """Reduce agents run (a retried request repeats its text: counted once)."""
        return len({t for t in self.texts if t.startswith("REDUCE level=")})


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Seen:
    record = Seen()
    original = handlers.chat_completions

    async def recording(request: Any) -> Any:
        body = await request.json()
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        if users and not (body.get("max_tokens") == 1 and users[0]["content"] == "ok"):
            record.texts.append(users[0]["content"])
        return await original(request)

    monkeypatch.setattr(handlers, "chat_completions", recording)
    return record


@pytest.fixture
def sim_backend(seen: Seen) -> Iterator[str]:
    with SimServer(SimConfig(fixed_ms=200)) as server:  # map turns take a while: kill mid-way
        yield "sim://" + server.url.split("://", 1)[1]


@pytest.fixture(scope="module")
def chain_redis(redis_server: RedisServer) -> str:
    url = redis_server.url.rsplit("/", 1)[0] + f"/{CHAIN_DB}"
    redis.from_url(url).flushdb()
    return url


@pytest.fixture(scope="module")
def chain_worker(chain_redis: str) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(chain_redis, name="chain", concurrency=8,
                           env={"AGENTBATCH_WORKER_IMPORTS": ",".join(ALLOWED)}).start()
    yield worker
    worker.stop(timeout=15)


SUBMITTER = """
import sys
from agentbatch import run_with_map_reduce, run_with_reduce
from tests.integration.test_pipeline_chain import REDUCE, Claim, Plan, Summary
kind, pid, backend, url = sys.argv[1:5]
common = dict(backend=backend, model="sim-model", redis_url=url, batch_id=pid,
              warm_prefix=False, reduce_fan_in=2)
if kind == "reduce":
    inputs = [{"i": i} for i in range(5)]
    run_with_reduce('Claim {i}.\\n@sim answer {{"claim": "c{i}"}}', inputs,
                    output_schema=Claim, reduce=REDUCE, reduce_schema=Summary, **common)
else:
    run_with_map_reduce('Plan.\\n@sim answer {{"items": ["a", "b", "c", "d"]}}', {}, Plan,
                        'Item {item}.\\n@sim answer {{"claim": "{item}"}}', Claim,
                        REDUCE, Summary, **common)
"""


def _poll(what: str, check: Any) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {DEADLINE_S}s: {what}")


def _start_and_kill(kind: str, pid: str, backend: str, url: str, first_batch: str) -> int:
    """Start the submitter, SIGKILL it once ``first_batch`` is in Redis; its return code."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    proc = subprocess.Popen([sys.executable, "-c", SUBMITTER, kind, pid, backend, url],
                            cwd=REPO, env=env)
    client = redis.from_url(url)
    try:
        _poll(f"{first_batch} submitted",
              lambda: client.exists(BatchKeys(first_batch).plan) or proc.poll() is not None)
        assert proc.poll() is None, "the submitter ended before it was killed"
        proc.send_signal(signal.SIGKILL)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        client.close()


@pytest.mark.parametrize("kind", ["reduce", "map_reduce"])
def test_a_killed_submitter_loses_nothing(kind: str, chain_worker: WorkerProcess,
                                          chain_redis: str, sim_backend: str,
                                          seen: Seen) -> None:
    pid = f"chain-{kind}-{uuid.uuid4().hex[:8]}"
    first = f"{pid}.map" if kind == "reduce" else f"{pid}.plan"
    assert _start_and_kill(kind, pid, sim_backend, chain_redis, first) == -signal.SIGKILL
    client = redis.from_url(chain_redis, decode_responses=True)
    assert not client.exists(PipelineKeys(pid).done)  # killed before the pipeline ended
    with get_pipeline(pid, redis_url=chain_redis) as handle:
        mapped, reduced = handle.wait(timeout=DEADLINE_S)
        progress = handle.progress()
    n = 5 if kind == "reduce" else 4
    assert [r.ok for r in mapped] == [True] * n
    expected = [f"c{i}" for i in range(5)] if kind == "reduce" else ["a", "b", "c", "d"]
    assert [r.output.claim for r in mapped] == expected
    # fan-in 2: 5 -> 3 -> 2 -> 1 reduce agents (reduce), 4 -> 2 -> 1 (map_reduce)
    levels = [3, 2, 1] if kind == "reduce" else [2, 1]
    assert reduced == Summary(summary="s", count=2)  # the last reduce agent had 2 inputs
    names = [s.name for s in progress.stages]
    assert names == ([] if kind == "reduce" else ["plan"]) + ["map"] + \
        [f"reduce{i + 1}" for i in range(len(levels))]
    assert [s.total for s in progress.stages if s.name.startswith("reduce")] == levels
    assert progress.done and progress.error is None and all(s.finished for s in progress.stages)
    assert seen.reduces() == sum(levels)  # each reduce agent ran exactly once

    # a duplicate 'stage finished' delivery submits nothing: the done record, the stage
    # guard, and (guard gone too, as for a racing delivery) submit.lua's "already exists"
    map_stage = 0 if kind == "reduce" else 1
    assert stage_finished(chain_redis, ALLOWED, pid, map_stage) == "duplicate"
    client.delete(PipelineKeys(pid).done)
    assert stage_finished(chain_redis, ALLOWED, pid, map_stage) == "duplicate"
    client.delete(PipelineKeys(pid).stage(map_stage + 1))
    assert stage_finished(chain_redis, ALLOWED, pid, map_stage) == "duplicate"
    assert seen.reduces() == sum(levels)
    assert client.hget(BatchKeys(f"{pid}.reduce1").meta, "total") == str(levels[0])


def test_a_spec_naming_imports_outside_the_allowlist_is_refused(chain_redis: str) -> None:
    pid = f"evil-{uuid.uuid4().hex[:8]}"
    opts = {"model": "m", "backend": "sim://127.0.0.1:1"}
    spec = PipelineSpec(pipeline_id=pid, map=StageSpec(task="{x}", options=opts),
                        reduce=StageSpec(task="{reduce_prompt}",
                                         options={**opts, "output_schema": "os:system",
                                                  "tools": ["subprocess:run"]}),
                        reduce_template="r")
    client = redis.from_url(chain_redis, decode_responses=True)
    client.set(PipelineKeys(pid).spec, spec.model_dump_json(), px=60_000)
    assert stage_finished(chain_redis, ALLOWED, pid, 0) == "refused"
    done = json.loads(client.get(PipelineKeys(pid).done))
    assert "AGENTBATCH_WORKER_IMPORTS" in done["error"] and "subprocess" in done["error"]
    assert not client.exists(BatchKeys(f"{pid}.reduce1").plan)
    with get_pipeline(pid, redis_url=chain_redis) as handle, \
            pytest.raises(PipelineError, match="AGENTBATCH_WORKER_IMPORTS"):
        handle.wait(timeout=DEADLINE_S)

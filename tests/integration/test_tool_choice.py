"""``tool_choice="required"`` end to end on both engines, over real HTTP to the simulator.

The task carries no ``@sim tool`` directive, so the simulator's scripted model answers at once
unless the request forces a call, as vLLM does for ``tool_choice="required"`` (and the
simulator now does too). With ``"auto"`` no agent calls the tool; with ``"required"`` every
agent's first turn is a call and its answer comes after the result.
"""

from __future__ import annotations

import pytest
import redis

from agentbatch import submit_batch
from tests.support.tools import Answer, price

pytestmark = [pytest.mark.redis]

IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
TASK = "Agent {i}: what does the kettle cost?"


@pytest.mark.parametrize("engine", ["embedded", "distributed"])
def test_required_makes_every_agent_call_a_tool_before_answering(
        engine: str, redis_url: str, sim_url: str, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)  # where the tool counts (embedded)
    url = None
    if engine == "distributed":
        request.getfixturevalue("start_workers")(1, concurrency=4, env=IMPORTS)
        url = redis_url
    inputs = [{"i": i} for i in range(6)]
    common = {"tools": [price], "output_schema": Answer, "backend": sim_url,
              "model": "sim-model", "redis_url": url}
    auto = submit_batch(TASK, inputs, **common).wait(timeout=120)
    assert all(r.ok and not r.tool_calls for r in auto)  # the model chose not to
    required = submit_batch(TASK, inputs, tool_choice="required", **common).wait(timeout=120)
    assert all(r.ok for r in required), [r.error for r in required if not r.ok]
    assert all([c.name for c in r.tool_calls] == ["price"] and r.turns == 2 for r in required)
    client = redis.from_url(redis_url)
    keys = client.keys("test:exec:price:a:*")
    assert keys and sum(int(client.get(k) or 0) for k in keys) >= 1  # the tool really ran

"""``required_tool_rounds`` end to end over real HTTP to the simulator, on both engines.

The task carries no ``@sim tool`` directive, so the simulator's scripted model answers at once
unless the request forces a call: in native mode a request carrying ``tool_choice="required"``
(as vLLM does), in json mode a turn schema that allows only ``{"tool_calls": ...}``. So the
number of tool rounds each agent took is the number of turns agentbatch forced.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentbatch import submit_batch
from tests.support.tools import Answer, pad

IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
TASK = "Agent {i}: read the pages, then answer."
AGENTS = 4


def _results(sim_url: str, redis_url: str | None, **options: Any) -> list[Any]:
    results = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], tools=[pad],
                           output_schema=Answer, backend=sim_url, model="sim-model",
                           redis_url=redis_url, tool_choice="required", max_turns=5,
                           **options).wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return results


@pytest.mark.parametrize("tool_calling", ["native", "json"])
def test_embedded_forces_exactly_the_rounds_asked(sim_url: str, tool_calling: str) -> None:
    one = _results(sim_url, None, tool_calling=tool_calling)
    assert all(len(r.tool_calls) == 1 and r.turns == 2 for r in one), \
        [(len(r.tool_calls), r.turns) for r in one]
    three = _results(sim_url, None, tool_calling=tool_calling, required_tool_rounds=3)
    assert all([c.turn for c in r.tool_calls] == [1, 2, 3] and r.turns == 4 for r in three), \
        [([c.turn for c in r.tool_calls], r.turns) for r in three]


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_workers_force_the_plans_rounds(
        redis_url: str, start_workers: Any, sim_url: str) -> None:
    start_workers(1, concurrency=4, env=IMPORTS)
    three = _results(sim_url, redis_url, required_tool_rounds=3)
    assert all(len(r.tool_calls) == 3 and r.turns == 4 for r in three), \
        [(len(r.tool_calls), r.turns) for r in three]

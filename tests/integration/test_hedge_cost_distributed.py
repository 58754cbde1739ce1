"""A hedged turn's losing request is paid for, on the distributed engine: its tokens are in
the agent's ``cost_usd`` and in the batch's spend in Redis (meta's ``spend``, added by the
winning turn's commit in the same atomic step as its compare-and-set).

Real ``agentbatch worker`` processes, a real redis-server, and a pool of three simulator
processes over HTTP, one slow (``tests/support/sim_pool.py``), with ``hedge_after=2.0`` and
a price table. The workers count the losers' tokens on the batch
(``stat:hedge_loser_*``, written within half a second); the results' costs must be their
replies' tokens plus exactly those, and the spend the same sum. No timing is asserted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import submit_batch
from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import cost_usd
from agentbatch.core.results import AgentResult
from agentbatch.sim.process import SimProcess
from tests.integration.test_hedge_cost_embedded import MODEL, PRICES, usage_sum
from tests.integration.test_pool_hedge_distributed import AGENTS, TASK, TOOL_CALLS, WAIT_S
from tests.support.sim_pool import slow_pool
from tests.support.tools import Answer, lookup
from tests.support.waits import poll_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def pool() -> Iterator[tuple[list[SimProcess], SimProcess]]:
    with slow_pool() as procs:
        yield procs


def accounts(results: list[AgentResult], counts: dict[str, Any]) -> tuple[float, float, float]:
    """(what the results say was paid, their replies' cost, the losers' cost)."""
    losers = Usage(prompt_tokens=int(counts.get("stat:hedge_loser_prompt_tokens", 0)),
                   completion_tokens=int(counts.get("stat:hedge_loser_completion_tokens", 0)))
    return (sum(r.cost_usd or 0.0 for r in results),
            cost_usd(usage_sum([r.usage for r in results]), PRICES), cost_usd(losers, PRICES))


def test_hedge_losers_tokens_are_in_cost_usd_and_the_fleet_spend(
        pool: tuple[list[SimProcess], SimProcess], redis_url: str, start_workers) -> None:
    sims, _slow = pool
    start_workers(2, concurrency=8)
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model=MODEL,
                          output_schema=Answer, tools=[lookup], backend=[s.url for s in sims],
                          hedge_after=2.0, timeout_per_turn=60, warm_prefix=False,
                          prices={MODEL: PRICES}, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == AGENTS
    assert all(r.ok and r.turns == TOOL_CALLS + 1 for r in results), \
        [r.error for r in results if not r.ok][:3]

    def settled(counts: dict[str, Any]) -> bool:
        paid, replies, losers = accounts(results, counts)
        return losers > 0 and paid == pytest.approx(replies + losers, rel=1e-9)

    def unsettled(counts: dict[str, Any]) -> str:
        paid, replies, losers = accounts(results, counts)
        return (f"results paid ${paid!r}, their replies ${replies!r} + the hedges' losers "
                f"${losers!r}; counters { {k: v for k, v in counts.items() if 'hedge' in k} }")

    # the workers write their hedge counters in the background (batch_stats): wait, with a
    # deadline, until the settled hedges' loser tokens are all on the batch
    counts: dict[str, Any] = poll_until(handle.status, settled, unsettled, timeout=60)
    paid = accounts(results, counts)[0]

    assert counts.get("stat:hedges", 0) >= 1 and counts["stat:hedge_loser_prompt_tokens"] > 0
    over = [r for r in results if (r.cost_usd or 0.0) > cost_usd(r.usage, PRICES) * (1 + 1e-9)]
    assert 1 <= len(over) <= counts["stat:hedges"], (len(over), counts["stat:hedges"])
    # the fleet's spend in Redis (added by the commits) is what the results say was paid
    spend = handle.progress().cost_usd
    assert spend == pytest.approx(paid, rel=1e-9), (spend, paid)

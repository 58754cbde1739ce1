"""A hedged turn's losing request is paid for: its tokens are in the agent's ``cost_usd`` and
the batch's spend (embedded engine; the distributed one is ``test_hedge_cost_distributed.py``).

A pool of three simulator processes over real HTTP, one slow (``tests/support/sim_pool.py``),
``hedge_after=2.0`` and a price table. The pool's counters say which tokens the losers took
(exact when both answered, else the duplicate prompt); the results' costs must be their own
replies' tokens plus exactly those, at the batch's prices, and the spend the same sum.
Assertions are sums and counts, never timings. The cap check's arithmetic is pinned without
servers at the end (``Budget``: the engine asks it before each turn).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentbatch import submit_batch
from agentbatch.core.agent_state import AgentState
from agentbatch.core.budget import Budget, WorkEstimate, turn_spend
from agentbatch.core.model_io import ModelResponse, Usage
from agentbatch.core.output import ParsedOutput
from agentbatch.core.plan import BatchPlan
from agentbatch.core.pricing import cost_usd
from agentbatch.core.turns import ModelReplied, TurnPolicy, step
from agentbatch.sim.process import SimProcess
from tests.integration.test_pool_hedge import TASK, TOOL_CALLS, echo
from tests.support.sim_pool import slow_pool
from tests.support.tools import Answer

AGENTS = 45  # as test_pool_hedge: ~30 homed on the fast servers, so the bar becomes known
MODEL = "sim-model"
# distinct prompt / completion prices; a cached prompt token priced as any other, so a
# loser's cached share (known only when it answered) cannot blur the sum
PRICES = {"prompt": 3.0, "cached_prompt": 3.0, "completion": 5.0}


@pytest.fixture
def pool() -> Iterator[tuple[list[SimProcess], SimProcess]]:
    with slow_pool() as procs:
        yield procs


def usage_sum(usages: list[Usage]) -> Usage:
    total = Usage()
    for u in usages:
        total = total + u
    return total


def test_hedge_losers_tokens_are_in_cost_usd_and_the_batch_spend(
        pool: tuple[list[SimProcess], SimProcess]) -> None:
    sims, _slow = pool
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model=MODEL,
                          output_schema=Answer, tools=[echo], backend=[s.url for s in sims],
                          hedge_after=2.0, timeout_per_turn=60, prices={MODEL: PRICES})
    results = handle.wait(timeout=300)
    assert all(r.ok and r.turns == TOOL_CALLS + 1 for r in results), \
        [r.error for r in results if not r.ok][:3]
    hedge = handle.stats()["pool"]["hedge"]
    assert hedge["hedges"] >= 1 and hedge["loser_prompt_tokens"] > 0, hedge

    replies = cost_usd(usage_sum([r.usage for r in results]), PRICES)
    losers = cost_usd(Usage(prompt_tokens=hedge["loser_prompt_tokens"],
                            completion_tokens=hedge["loser_completion_tokens"]), PRICES)
    paid = sum(r.cost_usd or 0.0 for r in results)
    assert losers > 0
    # what the results say was paid = their replies + every hedge's loser, no more, no less
    assert paid == pytest.approx(replies + losers, rel=1e-9), (paid, replies, losers)
    # the hedged agents are the ones paying more than their own replies
    over = [r for r in results if (r.cost_usd or 0.0) > cost_usd(r.usage, PRICES) * (1 + 1e-9)]
    assert 1 <= len(over) <= hedge["hedges"], (len(over), hedge)
    # the batch's spend is the same sum
    progress = handle.progress()
    assert progress.cost_usd == pytest.approx(paid, rel=1e-9), (progress.cost_usd, paid)


# --- the caps see what a hedge paid (the same reckoning the engines use) -----------------

def hedged_reply(state: AgentState) -> AgentState:
    """``state`` after a reply whose hedge lost a request of 1,000 prompt tokens."""
    reply = ModelResponse(text='{"answer": "x"}', usage=Usage(prompt_tokens=100,
                                                              completion_tokens=10),
                          hedge_usage=Usage(prompt_tokens=1000))
    policy = TurnPolicy(max_turns=3, max_retries=0,
                        parse_output=lambda t: ParsedOutput(ok=True, value=t))
    return step(policy, state, ModelReplied(reply))


def test_a_hedges_loser_counts_against_the_caps_and_the_commits_spend() -> None:
    before = AgentState(index=0, input={})
    after = hedged_reply(before)
    assert after.usage.prompt_tokens == 100  # the agent's own tokens: the reply's only
    assert after.hedge_usage == Usage(prompt_tokens=1000)
    own = cost_usd(after.usage, PRICES)
    loser = cost_usd(Usage(prompt_tokens=1000), PRICES)

    budget = Budget(PRICES, WorkEstimate(total=1, max_turns=3),
                    max_agent_cost_usd=own + loser / 2, max_cost_usd=own + loser / 2)
    budget.record(before, after)
    assert budget.spent == pytest.approx(own + loser)
    refusal = budget.refusal(after)  # own cost alone is under both caps; with the loser, over
    assert refusal is not None and "max_cost_usd" in refusal

    plan = BatchPlan(batch_id="b", total=1, model=MODEL, backends=["http://x"],
                     system_message="", prices={MODEL: PRICES})
    assert turn_spend(plan, before, after) == pytest.approx(own + loser)

"""A provider-batch turn hedged to the sync API whose sync answer won, and whose provider
batch completed that turn's request anyway: the provider bills it (at the batch prices), so
the batch's spend must say so (embedded engine; the distributed one is
``test_hedge_lost_batch_paid_distributed.py``).

The simulator serves the OpenAI batch API over real HTTP. Agent 0's messages carry
``@simbatch hold``: its request never finishes, so no provider batch holding it can end, and
every turn in it waits until the deadline's hedge time sends it to the sync API, which wins.
The other turns' requests have completed by then (0.3 s); the batch, cancelled once the sync
API answered all its turns, bills them. The spend must equal what the simulator charged
(``/sim/stats``: the sync API's tokens at the list prices plus ``batch_billed`` at the batch
prices), no more, no less. Sums and counts only, never timings.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import submit_batch
from agentbatch.core.pricing import cost_usd
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.batch_bill import billed_batch, charged_usd, sim_stats
from tests.support.provider_batch import MODEL, PRICES, sim_url
from tests.support.tools import Answer

TASK = "Agent {i}.{hold}"
N = 6
# the hedge time (deadline minus the sync turns still to run, on the router's 5 s prior)
# comes seconds after the batch's other requests have completed (0.3 s)
DEADLINE_S = 40.0
WAIT_S = 180.0


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.3,
                             batch_latency_spread=0.0)) as server:
        yield server


def inputs() -> list[dict[str, Any]]:
    return [{"i": i, "hold": "\n@simbatch hold" if i == 0 else ""} for i in range(N)]


def submit(sim: SimServer, **opts: Any):
    return submit_batch(TASK, inputs(), model=MODEL, backend=sim_url(sim),
                        output_schema=Answer, prices=PRICES, warm_prefix=False, max_turns=2,
                        pricing="batch", deadline=DEADLINE_S, **opts)


def test_a_hedged_turns_batch_answer_the_provider_billed_is_in_the_spend(
        sim: SimServer) -> None:
    handle = submit(sim)
    results = handle.wait(timeout=WAIT_S)
    handle.join(timeout=WAIT_S)  # its provider batches closed (and read) too
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    stats = handle.stats()["provider_batch"]
    assert stats["hedge_won_by_sync"] == N and stats.get("served_batch", 0) == 0, stats
    sim_said = sim_stats(sim.url)
    billed = billed_batch(sim_said, MODEL)
    assert sim_said["batch_billed"][MODEL]["requests"] >= 1, sim_said["batch_billed"]

    # every result was answered by the sync API and priced so
    for r in results:
        assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL]))
    # the spend is what the provider charged: the sync answers and the batch's bill
    charged = charged_usd(sim_said, MODEL, PRICES[MODEL])
    spend = handle.progress().cost_usd
    assert spend == pytest.approx(charged, rel=1e-9), (spend, charged, billed)
    # the spend the caps (max_cost_usd) check is the same
    assert handle.engine.budget.spent == pytest.approx(charged, rel=1e-9)
    # and counted: the turns and tokens the batch billed for turns the sync API answered
    assert stats["hedge_lost_batch_paid"] == sim_said["batch_billed"][MODEL]["requests"]
    assert stats["hedge_lost_batch_paid_prompt_tokens"] == billed.prompt_tokens
    assert stats["hedge_lost_batch_paid_completion_tokens"] == billed.completion_tokens

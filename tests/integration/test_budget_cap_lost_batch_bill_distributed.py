"""``max_cost_usd=`` counts what provider batches billed for hedged turns the sync API won,
fleet-wide: a cap reached through those billed items alone stops the next turns' claims
(distributed engine; the embedded one and the scenario are ``test_budget_cap_lost_batch_bill``).

A real worker process and redis-server. The first turns' tool (``wait_for_fleet_bill``)
returns once the worker has added the provider batch's bill to the batch's spend in Redis, so
every second turn's claim reads the spend after it.
"""

from __future__ import annotations

import pytest

from agentbatch import submit_batch
from agentbatch.sim import SimServer
from tests.integration.test_budget_cap_lost_batch_bill import (
    CAP_USD,
    DEADLINE_S,
    PRICES,
    WAIT_S,
    N,
    check_capped_by_billed_items,
)
from tests.integration.test_budget_cap_lost_batch_bill import sim as sim  # the fixture
from tests.support.bill_wait import wait_for_fleet_bill
from tests.support.provider_batch import MODEL, sim_url
from tests.support.tools import Answer

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TASK = 'Agent {i}.{hold}\n@sim tool wait_for_fleet_bill {{"key": "k{i}"}}'


def test_a_fleet_cap_is_reached_through_batch_items_billed_for_turns_the_sync_api_won(
        sim: SimServer, redis_url: str, start_workers) -> None:
    start_workers(1, concurrency=8)
    inputs = [{"i": i, "hold": "\n@simbatch hold" if i == 0 else ""} for i in range(N)]
    handle = submit_batch(TASK, inputs, model=MODEL, backend=sim_url(sim),
                          tools=[wait_for_fleet_bill], output_schema=Answer, prices=PRICES,
                          warm_prefix=False, max_turns=2, pricing="batch",
                          deadline=DEADLINE_S, max_cost_usd=CAP_USD, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    counts = handle.status()
    sync_usd, lost_usd = check_capped_by_billed_items(
        results, sim, counts["stat:hedge_won_by_sync"], counts["stat:hedge_lost_batch_paid"],
        counts)
    assert handle.progress().cost_usd == pytest.approx(sync_usd + lost_usd, rel=1e-9)

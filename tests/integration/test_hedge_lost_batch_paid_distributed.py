"""A provider-batch turn hedged to the sync API whose sync answer won, and whose provider
batch completed that turn's request anyway, on the distributed engine: the provider bills it
(at the batch prices), so the batch's spend in Redis (meta's ``spend``, which the claims'
``max_cost_usd`` check reads) must say so.

The scenario of ``test_hedge_lost_batch_paid.py`` (agent 0's request held, so the provider
batch never ends on its own; the others' requests completed before the deadline's hedge
time), with real ``agentbatch worker`` processes and a real redis-server. The worker reads
the bill once the provider batch it cancelled has ended, after the agents are done: the test
waits for it (with a deadline), then asserts the spend is what the simulator charged, no
more, no less. Sums and counts only, never timings.
"""

from __future__ import annotations

from typing import Any

import pytest

from agentbatch.core.pricing import cost_usd
from agentbatch.sim import SimServer
from tests.integration.test_hedge_lost_batch_paid import WAIT_S, N, submit
from tests.integration.test_hedge_lost_batch_paid import sim as sim  # the fixture
from tests.support.batch_bill import billed_batch, charged_usd, sim_stats
from tests.support.provider_batch import MODEL, PRICES
from tests.support.waits import poll_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def requests_billed(sim_said: dict[str, Any]) -> int:
    """The batch requests the simulator billed for ``MODEL``."""
    return int(sim_said["batch_billed"].get(MODEL, {}).get("requests", 0))


def test_a_hedged_turns_batch_answer_the_provider_billed_is_in_the_fleet_spend(
        sim: SimServer, redis_url: str, start_workers) -> None:
    start_workers(1, concurrency=8)
    handle = submit(sim, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    for r in results:  # every result was answered by the sync API and priced so
        assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL]))

    def read() -> tuple[dict[str, int], dict[str, Any]]:
        return handle.status(), sim_stats(sim.url)

    def on_the_batch(seen: tuple[dict[str, int], dict[str, Any]]) -> bool:
        counts, sim_said = seen
        billed = requests_billed(sim_said)
        return bool(billed) and counts.get("stat:hedge_lost_batch_paid", 0) >= billed

    def not_yet(seen: tuple[dict[str, int], dict[str, Any]]) -> str:
        counts, sim_said = seen
        return (f"the sim billed {sim_said['batch_billed']}; the batch counted "
                f"{ {k: v for k, v in counts.items() if 'lost' in k} }, spend "
                f"{handle.progress().cost_usd}")

    # the provider batch is cancelled once its turns all have their sync answer, and read
    # when it has ended: wait (with a deadline) until its bill is on the batch
    counts, sim_said = poll_until(read, on_the_batch, not_yet, timeout=60)
    billed = requests_billed(sim_said)

    assert counts["stat:hedge_won_by_sync"] == N, counts
    assert "stat:hedge_won_by_batch" not in counts
    tokens = billed_batch(sim_said, MODEL)
    assert counts["stat:hedge_lost_batch_paid"] == billed
    assert counts["stat:hedge_lost_batch_paid_prompt_tokens"] == tokens.prompt_tokens
    assert counts["stat:hedge_lost_batch_paid_completion_tokens"] == tokens.completion_tokens
    # the fleet's spend is what the provider charged: the sync answers and the batch's bill
    charged = charged_usd(sim_said, MODEL, PRICES[MODEL])
    spend = handle.progress().cost_usd
    assert spend == pytest.approx(charged, rel=1e-9), (spend, charged, tokens)

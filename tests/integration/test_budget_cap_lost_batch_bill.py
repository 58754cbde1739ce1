"""``max_cost_usd=`` counts what provider batches billed for hedged turns the sync API won:
a cap reached through those billed items alone stops the next turns (embedded engine).

The scenario of ``test_hedge_lost_batch_paid.py``: agent 0's batch request is held, so the
one provider batch of the six first turns cannot end on its own; every turn is hedged at the
deadline's hedge time and the sync API wins; the provider batch, cancelled, bills the five
requests that had completed. Here each first turn is a tool call, and the tool returns only
once that bill is on the batch's spend (a wait with a deadline), so every second turn is
checked against the cap after it.

The batch prices are set far above the sync ones (a test device, not a real price table), so
the premise holds whatever the token counts: the sync answers alone cost far less than the
cap, the five billed items alone far more. Each agent must then end ``budget_exceeded``
before its second turn is sent, the results' costs summing to less than the cap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import submit_batch, tool
from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import cost_usd
from agentbatch.core.results import AgentResult
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.batch_bill import charged_usd, sim_stats
from tests.support.provider_batch import MODEL, chat_requests, sim_url
from tests.support.tools import Answer

TASK = 'Agent {i}.{hold}\n@sim tool wait_for_bill {{"key": "k{i}"}}'
N = 6
DEADLINE_S = 40.0  # as test_hedge_lost_batch_paid.py: hedges come after 5 requests completed
WAIT_S = 180.0
BILL_WAIT_S = 120.0  # how long the tool waits for the bill at most
CAP_USD = 1.0
# USD per million tokens: the sync turns of six agents cost ~1e-3 (hundreds of tokens each);
# one billed batch item of 100 tokens alone costs 1.0
PRICES = {MODEL: {"prompt": 1.0, "completion": 1.0,
                  "batch_prompt": 10_000.0, "batch_completion": 10_000.0}}

_handle: list[Any] = []  # the running batch's handle, for the tool


def _billed() -> int:
    """Turns the running batch's provider batches billed after the sync API answered them."""
    return int(_handle[0].engine.provider.stats["hedge_lost_batch_paid"]) if _handle else 0


@tool
async def wait_for_bill(key: str) -> str:
    """Return once a provider batch's bill for hedged turns is on the batch's spend.

    Args:
        key: any key.
    """
    stop = time.monotonic() + BILL_WAIT_S
    while not _billed() and time.monotonic() < stop:
        await asyncio.sleep(0.05)
    return f"{key}: billed" if _billed() else f"{key}: no bill after {BILL_WAIT_S:g}s"


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.3,
                             batch_latency_spread=0.0)) as server:
        yield server


def test_a_cap_is_reached_through_batch_items_billed_for_turns_the_sync_api_won(
        sim: SimServer) -> None:
    inputs = [{"i": i, "hold": "\n@simbatch hold" if i == 0 else ""} for i in range(N)]
    handle = submit_batch(TASK, inputs, model=MODEL, backend=sim_url(sim), tools=[wait_for_bill],
                          output_schema=Answer, prices=PRICES, warm_prefix=False, max_turns=2,
                          pricing="batch", deadline=DEADLINE_S, max_cost_usd=CAP_USD)
    _handle.append(handle)
    try:
        results = handle.wait(timeout=WAIT_S)
        handle.join(timeout=WAIT_S)
    finally:
        _handle.clear()
    stats = handle.stats()["provider_batch"]
    sync_usd, lost_usd = check_capped_by_billed_items(
        results, sim, stats["hedge_won_by_sync"], stats["hedge_lost_batch_paid"], stats)
    assert handle.progress().cost_usd == pytest.approx(sync_usd + lost_usd, rel=1e-9)
    assert handle.engine.budget.spent == pytest.approx(sync_usd + lost_usd, rel=1e-9)


def check_capped_by_billed_items(results: list[AgentResult], sim: SimServer, won_by_sync: int,
                                 lost_paid: int, counts: object) -> tuple[float, float]:
    """What both engines' tests assert of the scenario: every agent stopped at the cap before
    its second turn, reached through the billed items alone. Returns (sync, billed) USD."""
    assert len(results) == N
    assert [r.error.kind if r.error else None for r in results] == ["budget_exceeded"] * N, \
        ([r.error for r in results], counts)
    sim_said = sim_stats(sim.url)
    billed = sim_said["batch_billed"].get(MODEL, {})
    assert won_by_sync == N, counts
    assert billed.get("requests", 0) == N - 1, billed
    assert lost_paid == N - 1, counts
    # the premise: the sync answers alone are under the cap, the billed items alone past it
    sync_usd = sum(r.cost_usd or 0.0 for r in results)
    lost_usd = charged_usd(sim_said, MODEL, PRICES[MODEL]) - cost_usd(
        sync_usage(sim_said), PRICES[MODEL])
    assert sync_usd < CAP_USD <= lost_usd, (sync_usd, lost_usd)
    assert all("max_cost_usd=1 reached" in r.error.message for r in results if r.error)
    assert chat_requests(sim) == N  # the six hedges; no second turn was sent
    return sync_usd, lost_usd


def sync_usage(stats: dict[str, Any]) -> Usage:
    """What the simulator's sync API served, as tokens (``/sim/stats``)."""
    return Usage(prompt_tokens=stats["prompt_tokens"], cached_tokens=stats["cached_tokens"],
                 completion_tokens=stats["completion_tokens"])

"""A long-lived worker's provider-batch side keeps per-batch state for a bounded number of
batches (``ProviderBatches._forget``): its routers, live counts, finished counts and the
billing terms of a turn the sync API answered. The billing terms were kept for every batch
the worker ever saw."""

from __future__ import annotations

from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.provider_batches import MAX_BATCHES_KEPT, ProviderBatches


async def _note(batch_id: str, what: str, n: int = 1) -> None:
    return None


def _plan(batch_id: str) -> BatchPlan:
    return BatchPlan(batch_id=batch_id, total=10, model="m", backends=["sim://127.0.0.1:1"],
                     system_message="", max_turns=3, pricing="batch")


def _turn_of(side: ProviderBatches, batch_id: str) -> None:
    """What ``ProviderBatches.complete`` keeps for a batch on each of its turns."""
    side._bill_terms[batch_id] = ({"input": 1.0}, None)
    side.router(_plan(batch_id))
    side.agent_finished(batch_id, 2)


def test_per_batch_state_is_bounded_and_the_newest_batches_kept() -> None:
    side = ProviderBatches(_note)
    extra = 44
    for i in range(MAX_BATCHES_KEPT + extra):
        _turn_of(side, f"b{i}")
    for kept in (side._routers, side._finished, side._bill_terms):
        assert len(kept) == MAX_BATCHES_KEPT
    assert "b0" not in side._bill_terms and f"b{extra - 1}" not in side._bill_terms
    newest = f"b{MAX_BATCHES_KEPT + extra - 1}"
    assert side._bill_terms[newest] == ({"input": 1.0}, None)
    assert newest in side._routers and newest in side._finished


def test_a_forgotten_batch_that_runs_on_gets_its_state_again() -> None:
    side = ProviderBatches(_note)
    for i in range(MAX_BATCHES_KEPT + 1):
        _turn_of(side, f"b{i}")
    assert "b0" not in side._routers
    _turn_of(side, "b0")  # its next turn
    assert "b0" in side._routers and side._bill_terms["b0"] == ({"input": 1.0}, None)
    assert len(side._routers) == MAX_BATCHES_KEPT
